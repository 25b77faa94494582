import pytest
import torch

# Tiny CPU matmuls: one thread avoids OpenMP spin contention on small (2-core) CI machines.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--fuzz-seeds", type=int, default=None, metavar="N",
                     help="seeds of each random engine-run test in tests/test_worker_fuzz.py "
                          "(default: 40 on the CPU, 8 per GPU backend and mode)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def models():
    """(target, MTP draft) on CPU in fp32, so greedy ties cannot flip."""
    from spec_helpers import make_models

    return make_models()


@pytest.fixture(scope="session")
def target(models):
    return models[0]


@pytest.fixture(scope="session")
def mtp(models):
    return models[1]
