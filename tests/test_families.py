"""The family matrix: a tiny random model of each decoder family transformers ships (finetune/testing/families.py),
one optimizer step of the debug recipe checked by `finetune.verify` against the float64 brute force, padded and
packed. Every case passes, mixtures of experts with their router balancing loss on, or (packed rows only) is refused
in one line naming the batching that is exact: a family whose layers carry state along the sequence (linear
attention, short convolutions, Mamba), or whose attention lets a packed row's sequences see one another (gpt-oss).
scripts/family_matrix.py writes the same cases' figures to docs/models.md."""

import re

import pytest
from transformers import AutoTokenizer

from finetune.testing.families import FAMILIES, REFUSED, family_folder, verify_argv
from finetune.tools import verify
from tests.data_files import smollm2_folder


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


@pytest.mark.e2e
@pytest.mark.parametrize("batching", ["padded", "packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_verify_passes_or_packing_is_refused(family, batching, tokenizer, tmp_path, capsys):
    code = verify.main(verify_argv(family_folder(tmp_path, family, tokenizer), family, batching))
    out, err = capsys.readouterr()
    if (family, batching) in REFUSED:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1, err[-3000:]
        assert re.search(REFUSED[family, batching], errors[0]), errors[0]
    else:
        assert code == 0 and "verify: PASS" in out, (out + err)[-3000:]
