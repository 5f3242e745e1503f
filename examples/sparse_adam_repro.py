"""Keras on TensorFlow: Adam moves an embedding row by how it got its gradient.

The same gradient, once as the `tf.IndexedSlices` an `Embedding` produces
(one row per token occurrence, a repeated token twice) and once as the
dense tensor it stands for (the repeats summed), gives two different Adam
steps in Keras 3: its sparse path squares each occurrence before the
repeats are summed. On JAX and PyTorch, Keras computes dense gradients,
and `keras_accum.AccumModel` applies the dense one on every backend.

    python examples/sparse_adam_repro.py
"""

import os

# The behaviour shown is TensorFlow's: `tf.IndexedSlices` exist only there.
os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# --8<-- [start:repro]
import keras
import numpy as np
import tensorflow as tf


def one_adam_step(gradient):
    table = keras.Variable(np.zeros((3, 2), "float32"))  # 3 tokens, dim 2.
    keras.optimizers.Adam(learning_rate=0.1).apply([gradient], [table])
    return table.numpy()[1]


# Token 1 occurs twice in the batch; each occurrence's gradient row is 1.
sparse = tf.IndexedSlices(
    values=tf.ones((2, 2)),
    indices=tf.constant([1, 1]),
    dense_shape=tf.constant([3, 2]),
)
dense = tf.convert_to_tensor(sparse)  # Row 1 is 2: the repeats summed.

print("sparse:", one_adam_step(sparse))  # [-0.1414 -0.1414]
print("dense: ", one_adam_step(dense))  # [-0.1 -0.1]
# --8<-- [end:repro]
