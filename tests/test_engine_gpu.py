"""The engine on CUDA in 16-bit: the same exactness checks, with 16-bit tolerances."""

import pytest
import torch

from cachecraft.checks import check_model
from cachecraft.model.loader import wrap_model
from tests.conftest import ARCHS, tiny_tokenizer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blending_is_exact_on_cuda(arch, dtype):
    torch.manual_seed(0)
    cls, make_config = ARCHS[arch]
    lm = wrap_model(arch, cls(make_config()), tiny_tokenizer(), torch.device("cuda"), dtype)
    report = check_model(lm, prompts=2, chunk_tokens=24)
    assert report.passed, report.to_dict()
