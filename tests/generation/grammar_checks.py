"""Checkers for the languages the constrained-decoding tests' grammars describe, written independently of any
grammar engine, so an output is judged by the language and not by the engine that produced it."""


def is_arith(s: str) -> bool:
    """`expr := term ("+" term)*`, `term := digit | "(" expr ")"` (the GBNF and Lark test grammars), by
    recursive descent."""
    def expr(i: int) -> int:
        i = term(i)
        while i < len(s) and s[i] == "+":
            i = term(i + 1)
        return i

    def term(i: int) -> int:
        if i < len(s) and s[i].isdigit():
            return i + 1
        if i < len(s) and s[i] == "(":
            i = expr(i + 1)
            if i < len(s) and s[i] == ")":
                return i + 1
        raise ValueError(s)

    try:
        return expr(0) == len(s)
    except ValueError:
        return False
