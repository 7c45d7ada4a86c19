"""Where an encoder student's weights start: the installed MiniLM, or the teacher's fine-tuned copy of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distill_support import pagoda
from safetensors.torch import load_file

from distill.modeling_student import check_teacher_init, from_minilm
from laya.paths import minilm_dir

# all-MiniLM-L6-v2's geometry, which a teacher must share for its encoder to seed a student
MINILM_SHAPE = {"num_attention_heads": 12, "intermediate_size": 1536, "max_position_embeddings": 512,
                "layer_norm_eps": 1e-12, "type_vocab_size": 2}


@pytest.fixture(scope="module")
def minilm_shaped_teacher(laya_checkpoint) -> Path:
    """A random Laya checkpoint whose encoder has MiniLM's shapes and vocabulary (4 layers), unlike MiniLM's weights."""
    return Path(laya_checkpoint(arch="bert", dtype="f32", hidden=384, layers=4, tokenizer_dir=str(minilm_dir()),
                                encoder_overrides=MINILM_SHAPE))


def test_teacher_init_copies_the_teacher_s_encoder_and_default_init_copies_minilm(minilm_shaped_teacher):
    teacher = load_file(str(minilm_shaped_teacher / "model.safetensors"))
    minilm = load_file(str(minilm_dir() / "model.safetensors"))
    seeded = from_minilm(3, [5, 3, 2], teacher=minilm_shaped_teacher)
    plain = from_minilm(3, [5, 3, 2])
    for i in range(3):
        name = f"encoder.layer.{i}.intermediate.dense.weight"
        assert torch.equal(seeded.layers[i].up.weight, teacher["encoder." + name])
        assert torch.equal(plain.layers[i].up.weight, minilm[name])
        assert not torch.equal(seeded.layers[i].up.weight, plain.layers[i].up.weight)
    assert torch.equal(seeded.word.weight, teacher["encoder.embeddings.word_embeddings.weight"])
    # the heads start alike: only the encoder's source differs
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(seeded.heads, plain.heads))
    with pytest.raises(ValueError, match="student.layers: 5 asked, the teacher's encoder has 4"):
        from_minilm(5, [5, 3, 2], teacher=minilm_shaped_teacher)


def test_init_layers_start_the_student_from_the_named_layers_in_order(minilm_shaped_teacher):
    """`student.init_layers: [0, 1, 3]` copies the teacher's layers 0, 1 and 3 into the student's 0, 1 and 2;
    the embeddings and heads start as with the first layers, and a pick past the teacher's depth is refused."""
    teacher = load_file(str(minilm_shaped_teacher / "model.safetensors"))
    picked = from_minilm(3, [5, 3, 2], teacher=minilm_shaped_teacher, pick=[0, 1, 3])
    first = from_minilm(3, [5, 3, 2], teacher=minilm_shaped_teacher)
    for i, j in enumerate([0, 1, 3]):
        for ours, theirs in (("up", "intermediate.dense"), ("query", "attention.self.query")):
            assert torch.equal(getattr(picked.layers[i], ours).weight,
                               teacher[f"encoder.encoder.layer.{j}.{theirs}.weight"])
    assert not torch.equal(picked.layers[2].up.weight, first.layers[2].up.weight)
    assert torch.equal(picked.word.weight, first.word.weight)
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(picked.heads, first.heads))
    with pytest.raises(ValueError, match="student.layers: 6 asked, the teacher's encoder has 4"):
        from_minilm(3, [5, 3, 2], teacher=minilm_shaped_teacher, pick=[0, 2, 5])
    with pytest.raises(ValueError, match="student.init_layers"):
        from_minilm(3, [5, 3, 2], pick=[0, 2])


@pytest.mark.parametrize("arch,needle", [("bert", "hidden_size 64 (MiniLM: 384)"),
                                         ("modernbert", "model_type 'modernbert' (MiniLM: 'bert')")])
def test_teacher_init_refuses_an_encoder_of_another_shape(laya_checkpoint, arch, needle):
    with pytest.raises(ValueError, match=r"student\.init: 'teacher' needs") as err:
        check_teacher_init(Path(laya_checkpoint(arch=arch, dtype="f32")), 3)
    assert needle in str(err.value) and "Use student.init: minilm" in str(err.value)


def test_cli_refuses_teacher_init_before_labelling(distill_inputs, tmp_path):
    task = tmp_path / "task.yaml"
    task.write_text(distill_inputs["task"].read_text().replace("  layers: 1\n", "  layers: 1\n  init: teacher\n"))
    assert "init: teacher" in task.read_text()
    proc = pagoda("distill", "--teacher", distill_inputs["teacher"], "--task", str(task), "--data",
                  str(distill_inputs["data"]), "--out", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2 and "error: student.init: 'teacher' needs" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o" / "labels").exists()
