"""How `select` turns the model's log-probabilities of each choice into a decision.

Which tokens of a choice are scored follows SGLang's frontend, so a program picks the same choice on
either frontend: with the prompt text tokenised to P tokens and prompt + choice to `ids`, the scored
tokens are `ids[max(P - 1, 1):]`. The prompt's last token is included because joint tokenisation may
merge it with the choice's first characters (a prompt ending in a space, a choice starting with a
letter); since every choice includes it, it shifts all scores alike when it does not merge.

Three methods, SGLang's three:
- `token_length_normalized` (the default): the highest mean log-probability per scored token;
- `greedy_token_selection`: compare choices token by token, keeping those with the best log-probability
  at each position (a shorter choice continues with its own mean), until one is left. Values within
  `TIE` count as equal: choices sharing their first tokens score those tokens in separate requests,
  whose last float bits may differ (SGLang compares exactly, so such ties fall either way there);
- `unconditional_likelihood_normalized`: the highest mean of log p(token | prompt) - log p(token | the
  choice's earlier tokens only), which discounts choices that are likely whatever the prompt says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Entry = tuple[float, int, str]  # (logprob, token id, token text), SGLang's logprob entry shape
TIE = 1e-5


def scored_from(prompt_tokens: int) -> int:
    """Index of the first scored token of prompt + choice, given the prompt's own token count."""
    return max(prompt_tokens - 1, 1)


@dataclass
class ChoiceScores:
    """Per choice, its scored tokens with their log-probabilities given the prompt, and (for the
    unconditional method) given only the choice's earlier scored tokens (the first one gets 0)."""

    choices: list[str]
    entries: list[list[Entry]]
    unconditional: list[list[float]] | None = None

    def normalized(self) -> list[float]:
        return [_mean([e[0] for e in es]) for es in self.entries]

    def meta(self) -> dict[str, Any]:
        return {"normalized_prompt_logprobs": self.normalized(),
                "input_token_logprobs": [[list(e) for e in es] for es in self.entries]}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _best(values: list[float]) -> int:
    """First index of the maximum (a tie goes to the choice listed first)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


class ChoiceMethod:
    """Picks a choice from its scores; `needs_unconditional` asks the backend for the extra scoring pass."""

    needs_unconditional = False

    def __call__(self, scores: ChoiceScores) -> tuple[int, dict[str, Any]]:
        raise NotImplementedError


class TokenLengthNormalized(ChoiceMethod):
    def __call__(self, scores: ChoiceScores) -> tuple[int, dict[str, Any]]:
        return _best(scores.normalized()), scores.meta()

    def __repr__(self) -> str:
        return "token_length_normalized"


class GreedyTokenSelection(ChoiceMethod):
    def __call__(self, scores: ChoiceScores) -> tuple[int, dict[str, Any]]:
        rows = [[e[0] for e in es] for es in scores.entries]
        width = max(len(r) for r in rows)
        matrix = [r + [_mean(r)] * (width - len(r)) for r in rows]
        left = list(range(len(rows)))
        for j in range(width):
            top = max(matrix[i][j] for i in left)
            left = [i for i in left if matrix[i][j] >= top - TIE]
            if len(left) == 1:
                break
        return left[0], {**scores.meta(), "greedy_logprob_matrix": matrix}

    def __repr__(self) -> str:
        return "greedy_token_selection"


class UnconditionalLikelihoodNormalized(ChoiceMethod):
    needs_unconditional = True

    def __call__(self, scores: ChoiceScores) -> tuple[int, dict[str, Any]]:
        if scores.unconditional is None:
            raise ValueError("unconditional_likelihood_normalized: the backend gave no unconditional scores")
        relative = [_mean([e[0] - u for e, u in zip(es, us)]) for es, us in zip(scores.entries, scores.unconditional)]
        meta = {**scores.meta(), "unconditional_token_logprobs": scores.unconditional,
                "normalized_unconditional_prompt_logprobs": relative}
        return _best(relative), meta

    def __repr__(self) -> str:
        return "unconditional_likelihood_normalized"


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
