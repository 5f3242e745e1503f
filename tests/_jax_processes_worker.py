"""`AccumModel` on JAX across two processes (`jax.distributed`).

Started twice by `test_jax_processes.py`, once per process, each with one
CPU device; `keras.distribution.initialize` joins them through a
coordinator on localhost, and `DataParallel` spans both devices (JAX's
CPU collectives, gloo):

    KERAS_BACKEND=jax python _jax_processes_worker.py PORT PROCESS OUT_DIR

Each process feeds `fit` its half of every global micro-batch (Keras
assembles the global batch from the processes' local ones). The model
trains one epoch with `partial_window="carry"`, so that a window is open
when it is saved (`model.save`), then a new model loaded from that file
trains a second epoch. Process 0 writes the weights after each epoch and
the iterations to `OUT_DIR/results.npz`, for the test to compare with a
plain `keras.Model` trained in one process on the whole windows.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One device per process: the distribution spans the two processes.
os.environ["XLA_FLAGS"] = " ".join(
    flag
    for flag in os.environ.get("XLA_FLAGS", "").split()
    if "xla_force_host_platform_device_count" not in flag
)

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _jax_processes_case as case


def main(port: str, process: str, out_dir: str) -> None:
    process = int(process)
    keras.distribution.initialize(f"localhost:{port}", 2, process)
    import jax

    if jax.process_count() != 2 or jax.device_count() != 2:
        raise RuntimeError(
            f"expected 2 processes and 2 devices, got {jax.process_count()} "
            f"and {jax.device_count()}"
        )
    # Each process feeds its own rows (`local_half`): no sharding by Keras.
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(auto_shard_dataset=False)
    )
    x, y = case.data()
    x_local, y_local = case.local_half(x, process), case.local_half(y, process)

    model = case.build(accum_steps=case.K)
    model.set_weights(case.initial_weights())
    model.fit(
        x_local,
        y_local,
        batch_size=case.B // 2,
        epochs=1,
        shuffle=False,
        verbose=0,
    )
    first = [np.asarray(w) for w in model.get_weights()]
    mini_step = int(np.asarray(model._window.counters.mini_step.value))
    path = os.path.join(out_dir, f"model{process}.keras")
    model.save(path)

    resumed = keras.saving.load_model(path)
    resumed_mini_step = int(
        np.asarray(resumed._window.counters.mini_step.value)
    )
    resumed.fit(
        x_local,
        y_local,
        batch_size=case.B // 2,
        epochs=2,
        initial_epoch=1,
        shuffle=False,
        verbose=0,
    )
    if process == 0:
        np.savez(
            os.path.join(out_dir, "results.npz"),
            *[np.asarray(w) for w in resumed.get_weights()],
            first_epoch=np.concatenate([w.ravel() for w in first]),
            iterations=[
                int(np.asarray(model.optimizer.iterations)),
                int(np.asarray(resumed.optimizer.iterations)),
            ],
            mini_step=[mini_step, resumed_mini_step],
        )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
