"""Real TensorFlow models for the TensorFlow front end's tests, built in a child process (`build(folder)`).

`python -m tests.support.tf_models FOLDER` writes a Keras CNN as a Keras 3 `export` SavedModel, a
`tf.saved_model.save` SavedModel, a frozen GraphDef and a `.keras` file; a SavedModel with two signatures and none
named serving_default; one using an op tf2onnx cannot convert (SVD); and TensorFlow's own outputs for fixed inputs
(`x.npy`, `y.npy`), so the test process never imports TensorFlow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

IMAGE_SHAPE = (16, 16, 3)
CLASSES = 4


def build(folder: Path) -> Path:
    """Builds the models once into `folder` (TensorFlow's import and the exports take ~15 s on 2 cores)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "tests.support.tf_models", str(folder)], env=env, text=True,
                          cwd=Path(__file__).parents[2], capture_output=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building the TensorFlow test models failed:\n{done.stderr[-3000:]}")
    return folder


def _write_models(folder: Path) -> None:
    import keras
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    keras.utils.set_random_seed(0)
    image = keras.Input(IMAGE_SHAPE, name="image")
    x = keras.layers.Conv2D(8, 3, activation="relu")(image)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    model = keras.Model(image, keras.layers.Dense(CLASSES, activation="softmax", name="probs")(x))
    # A trained-looking BatchNormalization: moving statistics away from 0 / 1, so folding them is exercised.
    norm = next(layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization))
    norm.set_weights([w + np.linspace(0.5, 1.5, w.size, dtype=np.float32) for w in norm.get_weights()])
    model.export(str(folder / "keras_export"), verbose=False)
    tf.saved_model.save(model, str(folder / "tf_saved"))
    model.save(folder / "cnn.keras")
    spec = tf.TensorSpec([None, *IMAGE_SHAPE], tf.float32, name="image")
    frozen = convert_variables_to_constants_v2(tf.function(lambda image: model(image)).get_concrete_function(spec))
    tf.io.write_graph(frozen.graph.as_graph_def(), str(folder), "frozen.pb", as_text=False)
    (folder / "frozen_outputs.txt").write_text(",".join(t.name.split(":")[0] for t in frozen.outputs))
    inputs = np.random.default_rng(0).standard_normal((5, *IMAGE_SHAPE)).astype(np.float32)
    np.save(folder / "x.npy", inputs)
    np.save(folder / "y.npy", model(inputs).numpy())
    _write_signatures(folder / "two_signatures")
    _write_svd(folder / "svd")


def _write_signatures(path: Path) -> None:
    import tensorflow as tf

    class Scale(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def double(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"y": x * 2.0}

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def triple(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"y": x * 3.0}

    module = Scale()
    tf.saved_model.save(module, str(path), signatures={"double": module.double, "triple": module.triple})


def _write_svd(path: Path) -> None:
    import tensorflow as tf

    class Svd(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4, 4], tf.float32, name="x")])
        def __call__(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"s": tf.linalg.svd(x, compute_uv=False)}

    tf.saved_model.save(Svd(), str(path))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    _write_models(target)
