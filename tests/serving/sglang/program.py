"""Run by the scratch venv's python (SGLang's frontend, not ours): a gen + select program against a server.

Prints one JSON line: what the program produced, so the test can check it against the server's own
answers to the same calls."""

import json
import sys

import sglang as sgl


@sgl.function
def program(s, question, choices):
    s += "Question: " + question + "\n"
    s += "Answer: " + sgl.gen("answer", max_tokens=6, temperature=0, stop="\n") + "\n"
    s += "Pick: " + sgl.select("pick", choices=choices)


def main() -> None:
    url, question = sys.argv[1], sys.argv[2]
    choices = json.loads(sys.argv[3])
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    state = program.run(question=question, choices=choices)
    meta = state.get_meta_info("pick")
    print(json.dumps({"answer": state["answer"], "pick": state["pick"], "text": state.text(),
                      "normalized": meta["normalized_prompt_logprobs"] if meta else None}))


if __name__ == "__main__":
    main()
