"""Real `pagoda serve` processes on ephemeral loopback ports, launched together once per session.

Importing torch and loading the model dominates a server's start, so both servers the suite needs boot
in parallel (and the in-process reference agent loads meanwhile); each test waits only for its own.
"""

from __future__ import annotations

import pytest
import yaml
from serving_support import (
    API_KEY,
    GEN_ENGINE_FLAGS,
    LONG_LLAMA_BLOCKS,
    REPO,
    STUDENT_TASK,
    TINY_BERT,
    ServerProcess,
)


@pytest.fixture(scope="session")
def billing_questions() -> dict:
    """The billing scenario's three questions, as the shipped support-triage preset holds them."""
    return yaml.safe_load((REPO / "serving/decide/presets.yaml").read_text())["support-triage"]


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-logs")
    model = ["--model", str(TINY_BERT)]
    procs = {
        # default limits and the example policy
        "main": ServerProcess(logs / "main.log", [*model, "--policy", str(REPO / "serving/decide/policy.example.yaml"),
                                                  "--max-wait-ms", "5"]),
        # auth on, a 2-state queue, a 1 s deadline; 256 questions (512k tokens) a request, so one can outlast it
        "guarded": ServerProcess(logs / "guarded.log", [*model, "--max-queue", "2", "--max-states", "2",
                                                        "--max-questions", "256", "--max-request-tokens", "524288",
                                                        "--request-timeout-s", "1.0"],
                                 env={"PAGODA_API_KEY": API_KEY}),
    }
    procs["main"].first_answer()
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.fixture(scope="session")
def agent():
    """The same checkpoint in-process: the reference every served answer must equal."""
    import laya

    return laya.load(TINY_BERT)


@pytest.fixture
def server(servers, agent):
    return servers["main"].running()


@pytest.fixture
def guarded(servers, agent):
    return servers["guarded"].running(headers={"Authorization": f"Bearer {API_KEY}"})


# ---- the generation API -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tests.generation.llama_builders import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def long_llama(tmp_path_factory):
    """The tiny Llama with 16k positions: long answers that take seconds even on a fast machine."""
    from tests.generation.llama_builders import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-16k"), max_positions=16384)


@pytest.fixture(scope="session")
def gen_servers(tmp_path_factory, tiny_llama, long_llama):
    """Two servers on the tiny Llama: `both` (decisions and generation, roomy limits) and `tight`
    (generation only, with small limits to hit: 1 waiting request, 2 request threads, 2 s deadline).

    `tight` runs the same tiny Llama with 16k positions and a pool to match: its 8000-token requests take
    seconds even on a fast machine (1023 tokens took 2.1 s here, so a 1024-position model could finish
    before the 2 s deadline and the deadline tests would pass or fail by machine speed)."""
    logs = tmp_path_factory.mktemp("gen-logs")
    llm = ["--generate-model", str(tiny_llama), "--generate-name", "tiny-llama", *GEN_ENGINE_FLAGS]
    tight_llm = ["--generate-model", str(long_llama), "--generate-name", "tiny-llama", *GEN_ENGINE_FLAGS,
                 *LONG_LLAMA_BLOCKS]
    procs = {
        "both": ServerProcess(logs / "both.log", ["--model", str(TINY_BERT), *llm, "--generate-max-new-tokens", "512",
                                                  "--generate-threads", "48", "--threads", "96"]),
        "tight": ServerProcess(logs / "tight.log", [*tight_llm, "--generate-only", "--generate-max-waiting", "1",
                                                    "--generate-threads", "2", "--generate-deadline-s", "2",
                                                    "--generate-max-prompt-tokens", "40", "--generate-max-n", "2",
                                                    "--generate-max-new-tokens", "8000"]),
    }
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.fixture(scope="session")
def gen_engine(tiny_llama):
    """The same model in-process, with the server's block size: the reference served answers must equal."""
    from generation import Engine, EngineConfig

    return Engine(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=512))


@pytest.fixture
def gen(gen_servers):
    return gen_servers["both"].running()


@pytest.fixture
def tight(gen_servers):
    return gen_servers["tight"].running()


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """Generation only, on a 2-layer random Llama with SmolLM2's own tokenizer and chat template: constrained
    decoding and tool calls over HTTP, whose structure comes from the constraint (the weights are noise)."""
    from tests.generation.test_constraints import build_tiny_smollm2

    folder = build_tiny_smollm2(tmp_path_factory.mktemp("tiny-smollm2-http"))
    proc = ServerProcess(tmp_path_factory.mktemp("smollm2-log") / "serve.log",
                         ["--generate-only", "--generate-model", str(folder), "--generate-name", "tiny-smollm2",
                          *GEN_ENGINE_FLAGS, "--generate-max-new-tokens", "512", "--generate-threads", "8",
                          "--generate-max-tools", "4"])
    server = proc.running()
    server.folder = folder
    yield server
    proc.stop()


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_server):
    """The same model in-process, with the server's block size: the reference served answers must equal."""
    from generation import Engine, EngineConfig

    return Engine(EngineConfig(model=str(smollm2_server.folder), block_size=4, num_blocks=512, num_threads=1))


@pytest.fixture(scope="session")
def student_folder(tmp_path_factory):
    """A linear student of the tiny BERT checkpoint (`STUDENT_TASK`), distilled by `pagoda distill` in seconds."""
    import subprocess
    import sys

    from distill.corpus import write_corpus

    d = tmp_path_factory.mktemp("student")
    (d / "task.yaml").write_text(yaml.safe_dump(STUDENT_TASK, sort_keys=False))
    data = write_corpus(d / "tickets.jsonl", 80, seed=3)
    out = d / "serve-triage"
    subprocess.run([sys.executable, "-m", "serving.cli", "distill", "--teacher", str(TINY_BERT), "--task",
                    str(d / "task.yaml"), "--data", str(data), "--out", str(out), "--no-progress"],
                   cwd=REPO, check=True, capture_output=True, timeout=900)
    return out
