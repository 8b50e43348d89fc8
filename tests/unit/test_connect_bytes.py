"""What connecting ahead sends per direction (``transport.connect.connect_bytes``)."""

from __future__ import annotations

import pytest
import torch

from elastic_refit.transport.connect import CONNECT_BYTES_GPU, connect_bytes

GPU = torch.device("cuda", 0)  # only its type is read: no GPU needed


def test_a_cpu_sends_one_byte_and_a_gpu_a_few_mib_by_default(monkeypatch):
    monkeypatch.delenv("ELASTIC_REFIT_CONNECT_AHEAD_MIB", raising=False)
    assert connect_bytes(torch.device("cpu")) == 1
    assert connect_bytes(GPU) == CONNECT_BYTES_GPU == 4 << 20


@pytest.mark.parametrize("value, nbytes", [("1", 1 << 20), ("64", 64 << 20), ("1024", 1 << 30)])
def test_the_environment_sets_a_gpu_s_mib(monkeypatch, value, nbytes):
    monkeypatch.setenv("ELASTIC_REFIT_CONNECT_AHEAD_MIB", value)
    assert connect_bytes(GPU) == nbytes
    assert connect_bytes(torch.device("cpu")) == 1  # gloo has no bulk path to warm


@pytest.mark.parametrize("value", ["0", "1025", "-4", "4.5", "lots", ""])
def test_a_bad_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("ELASTIC_REFIT_CONNECT_AHEAD_MIB", value)
    with pytest.raises(ValueError, match=f"ELASTIC_REFIT_CONNECT_AHEAD_MIB must be an integer from 1 to 1024, got {value!r}"):
        connect_bytes(GPU)
