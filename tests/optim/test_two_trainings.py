"""No guessing from outside (DESIGN section of that name): two trainings in one process behave as
each would alone.

What the wrapper does may depend only on the calls it receives and its arguments, never on other
libraries' global state (sys.modules, Accelerate's GradientState singleton, ...). So a training
run right after another one in the same process -- without anyone resetting Accelerate's
singletons in between, as in a notebook or a sweep script -- must give exactly the result it gives
alone (fresh process state), and that result must be native's.

Each run: tiny GPT-2, 6 micro-batches per epoch, two epochs, gradient accumulation 4 (windows
4, 2 per epoch), clipping active in every window. Frameworks get ``accumulation_steps=None``
(they call step() only at window ends); the plain loop gets ``accumulation_steps=4`` and calls
step()/zero_grad() every micro-batch, clipping where ``opt.sync_step`` says and flush()-ing the
short window at the end of the data. Compared: losses, the norm of p.grad after every
micro-batch, the pre-clip norms, the params (see tests/_native_common.py for tolerances). The
"alone" run is the identical run after resetting Accelerate's singletons: bit-for-bit equal.

Why the wrapper before commit 1a87787 failed the pairs that start with Accelerate,
besides the visibility failures of test_native_equivalence.py: it read Accelerate's process-wide
GradientState, left by the earlier training with sync_gradients=True and num_steps=4, and so ended
the window after every backward of the next training (Lightning: "a backward pass started after
the window ... was complete"; the plain loop stepped every micro-batch).
"""

from __future__ import annotations

import pytest
from _native_common import (
    GPT_CLIP,
    accelerate_state_reset_after,  # noqa: F401  (fixture)
    assert_moved,
    assert_runs_match,
    random_seed,
    reset_accelerate,
    run_accelerate,
    run_lightning,
    run_plain,
    run_trainer,
)

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

WINDOWS = 4  # 4, 2 per epoch, two epochs
SAMPLES = 12  # 6 micro-batches of 2 per epoch


def _run(kind: str, start, samples, tmp_path, label: str, *, wrap: bool):
    if kind == "accelerate":
        return run_accelerate(start, samples, wrap=wrap, accumulation_steps=None)
    if kind == "lightning":
        return run_lightning(start, samples, wrap=wrap, accumulation_steps=None)
    if kind == "trainer":
        return run_trainer(start, samples, tmp_path / label, wrap=wrap, accumulation_steps=None)
    assert kind == "plain"
    return run_plain(start, samples, wrap=wrap)


@pytest.mark.usefixtures("accelerate_state_reset_after")
@pytest.mark.parametrize("first, second", [
    ("accelerate", "lightning"),
    ("lightning", "accelerate"),
    ("accelerate", "plain"),
    ("trainer", "plain"),
])
def test_second_training_behaves_as_alone(first, second, tmp_path):
    from _integrations_common import tiny_gpt2, token_batches

    start_a, start_b = tiny_gpt2(seed=random_seed()), tiny_gpt2(seed=random_seed())
    samples_a = token_batches(SAMPLES, seed=random_seed())
    samples_b = token_batches(SAMPLES, seed=random_seed())

    # The pair, back to back in one process; nothing is reset between the two trainings.
    reset_accelerate()
    a = _run(first, start_a, samples_a, tmp_path, "a", wrap=True)
    b = _run(second, start_b, samples_b, tmp_path, "b", wrap=True)

    # Each alone (fresh Accelerate state), and natively.
    reset_accelerate()
    b_alone = _run(second, start_b, samples_b, tmp_path, "b_alone", wrap=True)
    reset_accelerate()
    a_native = _run(first, start_a, samples_a, tmp_path, "a_native", wrap=False)
    reset_accelerate()
    b_native = _run(second, start_b, samples_b, tmp_path, "b_native", wrap=False)

    for native in (a_native, b_native):
        assert len(native.clip_norms) == WINDOWS, native.clip_norms
        assert all(n > GPT_CLIP for n in native.clip_norms), native.clip_norms
    assert_runs_match(b, b_alone, f"{second} after {first} vs {second} alone", rel=0, atol=0)
    assert_runs_match(a, a_native, f"{first} (first) vs native")
    assert_runs_match(b, b_native, f"{second} after {first} vs native")
    for run, start in ((a, start_a), (b, start_b)):
        assert all(s["step"].item() == WINDOWS for s in run.opt.state.values())
        assert_moved(run.model, start)
