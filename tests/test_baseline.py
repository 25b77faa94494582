"""Target-only greedy decoding (specdec.baseline.GreedyDecoder) on the CPU."""

import pytest
import torch

from specdec.baseline import GreedyDecoder, greedy_generate, sequence_logits
from spec_helpers import make_models, prompts


def test_steps_decode_the_argmax_of_the_full_sequence_logits():
    target, _ = make_models()
    prompt = prompts(1, seed=3)[0]
    decoder = GreedyDecoder(target, [prompt], 6)
    for _ in range(5):
        decoder.step()
    out = decoder.outputs()[0]
    logits = sequence_logits(target, prompt + out[:-1])  # one prefill of the whole sequence, no decode steps
    assert out == logits[len(prompt) - 1:].argmax(-1).tolist()


def test_empty_prompts_are_refused_and_array_prompts_taken():
    import numpy as np

    target, _ = make_models()
    lists = prompts(2, seed=4)
    arrays = [np.array(p) for p in lists]
    assert greedy_generate(target, arrays, 3) == greedy_generate(target, lists, 3)
    for bad in ([], [[1, 2], []]):
        with pytest.raises(ValueError, match="every prompt at least one token"):
            GreedyDecoder(target, bad, 3)


def test_a_step_past_its_room_is_refused_and_changes_nothing():
    target, _ = make_models()
    decoder = GreedyDecoder(target, prompts(2, seed=1), 3)
    decoder.step()
    decoder.step()
    before = decoder.outputs()
    with pytest.raises(RuntimeError, match="max_new_tokens"):
        decoder.step()
    assert decoder.outputs() == before and [len(out) for out in before] == [3, 3]


def test_built_outside_inference_mode_it_records_no_autograd():
    target, _ = make_models()
    decoder = GreedyDecoder(target, prompts(2, seed=2), 4)
    assert decoder.run.prefill_hidden.grad_fn is None
    assert not any(buf.requires_grad for buf in decoder.run.pool.view().kv_buffers)


@pytest.mark.parametrize("backend", ["trtllm_mla", "cutedsl_mla", "tokenspeed_mla"])
def test_kernels_the_device_cannot_run_are_refused_up_front(backend):
    """The decoder refuses a backend this device cannot run before building it, as the worker does:
    a ValueError naming the backend, its role and the GPU it needs, and asking for one that runs
    here (not an error from inside the kernel or its prefill fallback)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("this is a Blackwell GPU")
    target, _ = make_models()
    with pytest.raises(ValueError, match=f"{backend} \\(target\\) needs a SM10\\S* GPU.*set attention_backend to one that runs here"):
        greedy_generate(target, prompts(1, seed=3), 3, backend=backend)
