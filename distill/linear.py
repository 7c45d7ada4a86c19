"""The linear student: TF-IDF + one logistic regression per question, exported with skl2onnx.

The cheap baseline the encoder student must beat. Soft targets go in as sample weights: each row
appears once per option with weight p_teacher(option), which makes scikit-learn's log loss the
cross-entropy to the teacher's distribution, i.e. KL up to a constant. The exported graph is
skl2onnx's TF-IDF followed by one MatMul + Add producing the same `logits` output as the encoder
student (binary heads get a zero logit for option 0), so the runtime treats both kinds alike.
Texts are normalised in Python on both sides (`distill.inputs.normalise_words`: lowercase,
scikit-learn's word pattern, joined by single spaces), and the graph splits on spaces only. ONNX
Runtime's regex engine (RE2) and its StringNormalizer (which needs a named locale an edge box may
lack) would otherwise tokenise differently from scikit-learn, and the exported student would not be
the one that was fitted.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from distill.fidelity import mean_kl
from distill.inputs import normalise_words

C_GRID = (1.0, 4.0, 16.0)


def _fit_head(x, t: np.ndarray, c: float, seed: int):
    from sklearn.linear_model import LogisticRegression

    n, k = t.shape
    xs = _vstack([x] * k)
    ys = np.repeat(np.arange(k), n)
    w = t.T.reshape(-1)
    return LogisticRegression(C=c, max_iter=500, random_state=seed).fit(xs, ys, sample_weight=w)


def _vstack(parts):
    import scipy.sparse as sp

    return sp.vstack(parts).tocsr()


def _weights(clf, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(F, k) weights and (k,) bias giving logits whose softmax is the classifier's probabilities."""
    if k == 2:
        w = np.stack([np.zeros_like(clf.coef_[0]), clf.coef_[0]], axis=1)
        b = np.array([0.0, clf.intercept_[0]])
    else:
        w, b = clf.coef_.T, clf.intercept_
    return w.astype(np.float32), b.astype(np.float32)


def fit_linear(heads: list[dict], train_texts: list[str], train_t: dict[str, np.ndarray], val_texts: list[str],
               val_t: dict[str, np.ndarray], seed: int = 0):
    """Fit the vectorizer once, each head's C on validation KL; returns (vectorizer, W, b)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from tqdm.auto import tqdm

    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, max_features=20000, dtype=np.float32)
    x, xv = vec.fit_transform(normalise_words(train_texts)), vec.transform(normalise_words(val_texts))
    ws, bs = [], []
    for h in tqdm(heads, desc="fit linear student", unit="question"):
        best = None
        for c in C_GRID:
            clf = _fit_head(x, train_t[h["name"]], c, seed)
            kl = mean_kl(val_t[h["name"]], clf.predict_proba(xv))
            if best is None or kl < best[0]:
                best = (kl, clf)
        w, b = _weights(best[1], h["size"])
        ws.append(w)
        bs.append(b)
    return vec, np.concatenate(ws, axis=1), np.concatenate(bs)


def sklearn_logits(vec, w: np.ndarray, b: np.ndarray, texts: list[str]) -> np.ndarray:
    return np.asarray(vec.transform(normalise_words(texts)) @ w + b, dtype=np.float32)


def export(vec, w: np.ndarray, b: np.ndarray, path: Path) -> None:
    import onnx
    from onnx import helper, numpy_helper
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType

    graph_model = convert_sklearn(vec, initial_types=[("text", StringTensorType([None, 1]))], target_opset=17,
                                   options={id(vec): {"locale": "C", "tokenexp": None, "separators": [" "]}})
    g = graph_model.graph
    features = g.output[0].name
    g.initializer.extend([numpy_helper.from_array(w, "student_W"), numpy_helper.from_array(b, "student_b")])
    g.node.extend([helper.make_node("MatMul", [features, "student_W"], ["student_xw"]),
                   helper.make_node("Add", ["student_xw", "student_b"], ["logits"])])
    del g.output[:]
    g.output.extend([helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [None, w.shape[1]])])
    onnx.checker.check_model(graph_model)
    tmp = path.with_suffix(".tmp.onnx")
    onnx.save(graph_model, str(tmp))
    os.replace(tmp, path)
