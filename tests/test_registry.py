"""Backend selection and validation rules; no kernel library is imported here."""

import sys
import warnings

import numpy as np
import pytest
import torch

from attn.registry import check_device, check_kv_dtype, check_page_size, check_tree_support, resolve_backends
from specdec.config import ConfigError, SpecConfig


def test_cutedsl_prefill_and_draft_extend_fall_back_to_trtllm():
    choice = resolve_backends("cutedsl_mla")
    assert (choice.target, choice.draft, choice.draft_extend, choice.prefill) == ("cutedsl_mla", "cutedsl_mla", "trtllm_mla", "trtllm_mla")


def test_tokenspeed_serves_every_role_itself():
    choice = resolve_backends("tokenspeed_mla")
    assert set(vars(choice).values()) == {"tokenspeed_mla"}


def test_blackwell_query_lengths_fit_the_decode_kernel():
    with pytest.raises(ConfigError, match="at most 8 query tokens per request, got 9"), pytest.warns(UserWarning):
        SpecConfig(attention_backend="trtllm_mla", num_steps=8)
    SpecConfig(attention_backend="trtllm_mla", num_steps=7, page_size=64)


@pytest.mark.parametrize("kw", [dict(attention="cutedsl_mla", prefill="cutedsl_mla"), dict(attention="trtllm_mla", prefill="cutedsl_mla")])
def test_cutedsl_refused_as_prefill(kw):
    with pytest.raises(ValueError, match="prefill_backend 'cutedsl_mla' is decode-only.*trtllm_mla"):
        resolve_backends(kw["attention"], None, kw["prefill"])


def test_cutedsl_as_decode_backend_keeps_its_own_draft():
    choice = resolve_backends("trtllm_mla", "cutedsl_mla")
    assert choice.draft == "cutedsl_mla" and choice.prefill == "trtllm_mla"


@pytest.mark.parametrize("name", ["trtllm_mla", "cutedsl_mla", "tokenspeed_mla"])
def test_blackwell_page_size_warns_and_becomes_64(name):
    with pytest.warns(UserWarning, match="using page_size 64"):
        assert check_page_size(resolve_backends(name), 16) == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_page_size(resolve_backends(name), 32) == 32


def test_kv_dtype_rules():
    check_kv_dtype(resolve_backends("cutedsl_mla"), "fp8_e4m3")
    check_kv_dtype(resolve_backends("cutedsl_mla"), "bf16")
    check_kv_dtype(resolve_backends("tokenspeed_mla"), "fp8_e4m3")
    with pytest.raises(ValueError, match="tokenspeed_mla .* kv_dtype"):
        check_kv_dtype(resolve_backends("tokenspeed_mla"), "bf16")
    with pytest.raises(ValueError, match="cutedsl_mla"):
        check_kv_dtype(resolve_backends("cutedsl_mla"), "fp32")


def test_trees_need_tree_mask_backends():
    check_tree_support(resolve_backends("torch_ref"), 4)
    with pytest.raises(ValueError, match="trtllm_mla \\(target\\) cannot attend with a tree mask"):
        check_tree_support(resolve_backends("trtllm_mla"), 2)


@pytest.mark.parametrize("name", ["trtllm_mla", "cutedsl_mla", "tokenspeed_mla"])
def test_blackwell_refused_off_sm100_before_any_library_import(name):
    before = set(sys.modules)
    with pytest.raises(ValueError, match=f"{name} .* needs a SM10\\S* GPU .* set attention_backend to one that runs here: \\['torch_ref'\\]"):
        check_device(resolve_backends(name), torch.device("cpu"))
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("flashinfer", "tokenspeed_mla", "cutlass")}


def test_required_sm_takes_majors_and_major_minor_pairs(monkeypatch):
    """tokenspeed-mla runs on SM 10.0, 10.3 and 10.7 only; trtllm-gen on every 10.x."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    for capability, refused in (((10, 0), False), ((10, 3), False), ((10, 1), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        if refused:
            with pytest.raises(ValueError, match=f"tokenspeed_mla .* needs a SM100/SM103/SM107 GPU but runs on the "
                                                 f"SM{capability[0]}{capability[1]} GPU a test GPU"):
                check_device(resolve_backends("tokenspeed_mla"), torch.device("cuda"))
        else:
            check_device(resolve_backends("tokenspeed_mla"), torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 1))
    check_device(resolve_backends("trtllm_mla"), torch.device("cuda"))


def test_config_errors_name_the_setting():
    for kw, needle in [
        (dict(topk=4, num_draft_tokens=3), "topk"),
        (dict(num_steps=3, num_draft_tokens=6), "num_draft_tokens"),
        (dict(topk=2, num_steps=2, num_draft_tokens=8), "num_draft_tokens"),
        (dict(attention_backend="nope"), "attention_backend must be one of .*got 'nope'"),
        (dict(decode_backend="nope"), "decode_backend must be one of .* or None, got 'nope'"),
        (dict(prefill_backend="nope"), "prefill_backend must be one of .* or None, got 'nope'"),
        (dict(attention_backend=["triton_mla"]), "attention_backend must be one of"),  # an unhashable value: a ValueError too
        (dict(kv_dtype=["bf16"]), "kv_dtype must be 'auto' or one of"),  # likewise
        (dict(page_size=24), "page_size"),
        (dict(kv_dtype="int4"), "kv_dtype"),
        (dict(draft_mode="medusa"), "draft_mode"),
        (dict(attention_backend="trtllm_mla", page_size=64, topk=2, num_draft_tokens=4), "tree mask"),
        (dict(num_steps=2.5), "num_steps must be an int"),
        (dict(num_steps="3"), "num_steps must be an int"),
        (dict(max_context_len=0), "max_context_len"),
        (dict(max_context_len=16, page_size=16, num_steps=20), "max_context_len .16. leaves no room"),
        (dict(max_batch_size=2**20, max_context_len=4096), "2\\*\\*31"),
        (dict(num_pages=1), "num_pages must be at least 2"),
        (dict(cuda_graph_batch_sizes=None), "cuda_graph_batch_sizes must be a list of ints"),
        (dict(cuda_graph_batch_sizes=[2.5]), "cuda_graph_batch_sizes must be a list of ints"),
        (dict(cuda_graph_batch_sizes=[True]), "cuda_graph_batch_sizes must be a list of ints"),
        (dict(cuda_graph_batch_sizes="12"), "cuda_graph_batch_sizes must be a list of ints"),
        (dict(enable_sampling="no"), "enable_sampling must be a bool"),
        (dict(kv_dtype="fp8_e4m3", kv_scale=10**400), "kv_scale must be a finite number"),
        (dict(attention_backend="cutedsl_mla", page_size=64, max_context_len=192), "multiple of 128; raise it to 256"),
        (dict(attention_backend="trtllm_mla", page_size=64, num_steps=8, max_context_len=512), "lower num_steps"),
        (dict(attention_backend="torch_ref", decode_backend="trtllm_mla", page_size=64, topk=2, num_draft_tokens=4),
         "set decode_backend to one of"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            SpecConfig(**kw)


def test_config_copies_derive_their_own_pages_and_workers_revalidate():
    import dataclasses

    from specdec.worker import EagleWorker

    small = SpecConfig(max_batch_size=np.int64(2), max_context_len=64, page_size=np.int64(16))  # numpy ints are ints
    assert type(small.page_size) is int and type(small.max_batch_size) is int
    with pytest.raises(ConfigError, match="2\\*\\*31"):  # no int32 wrap-around
        SpecConfig(max_batch_size=np.int32(2**20), max_context_len=np.int32(4096))
    big = dataclasses.replace(small, max_batch_size=8, max_context_len=256)
    assert (small.pool_pages, big.pool_pages) == (2 * 4 + 1, 8 * 16 + 1)
    chain = SpecConfig(num_steps=3)  # num_draft_tokens derived (4): a copy of another depth derives its own
    with pytest.raises(ConfigError, match="set num_draft_tokens=None"):
        dataclasses.replace(chain, num_steps=5)
    assert dataclasses.replace(chain, num_steps=5, num_draft_tokens=None).num_draft_tokens == 6
    chain.num_steps, chain.num_draft_tokens = 4, None  # edited in place: validate (as the worker does) derives it
    chain.validate()
    assert chain.num_draft_tokens == 5
    small.max_batch_size = 0  # changed after construction: the worker validates it again
    with pytest.raises(ConfigError, match="max_batch_size"):
        EagleWorker(torch.nn.Linear(1, 1), None, small)


def test_config_page_size_adjusted_for_blackwell():
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match=r"page_size \(64, the backends' for the 16 given\)"):
        SpecConfig(attention_backend="trtllm_mla", page_size=16, max_context_len=96)
    with pytest.warns(UserWarning):
        cfg = SpecConfig(attention_backend="trtllm_mla", page_size=16, max_context_len=512)
    assert cfg.page_size == 64 and cfg.pool_pages == cfg.max_batch_size * 8 + 1


def test_a_config_that_fails_validation_is_left_as_it_was():
    """A validate that fails changes nothing: the page size it would adjust and the ints and
    kv_scale it would normalise stay as the caller set them, so an engine that catches the error
    and undoes its own edit is back where it was; a validate that passes then normalises them."""
    cfg = SpecConfig(max_context_len=96)
    cfg.attention_backend, cfg.max_batch_size, cfg.kv_scale = "trtllm_mla", np.int64(4), np.float32(1.0)
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match=r"page_size \(64, the backends' for the 16"):
        cfg.validate()
    assert (cfg.page_size, type(cfg.max_batch_size), type(cfg.kv_scale)) == (16, np.int64, np.float32)
    cfg.attention_backend = "torch_ref"
    cfg.validate()
    assert (cfg.page_size, type(cfg.max_batch_size), type(cfg.kv_scale)) == (16, int, float)


def test_graph_batch_sizes_take_any_sequence_of_ints():
    """A range, a tuple or a numpy array of batch sizes becomes a list of Python ints."""
    for sizes in (range(1, 4), (1, 2, 3), np.array([1, 2, 3])):
        assert SpecConfig(cuda_graph_batch_sizes=sizes).cuda_graph_batch_sizes == [1, 2, 3]
