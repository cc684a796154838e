"""bench/kernel_ablation.py: every variant's patch still applies to the tree (each text once in its
file), and one that does not is named, so the tool keeps measuring the code as it is."""
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import kernel_ablation  # noqa: E402  (no torch, no build: the patches only)


@pytest.mark.parametrize("name", [n for n in kernel_ablation.VARIANTS if n != "base"])
def test_every_patch_applies_once_and_changes_its_file(name):
    patches = kernel_ablation.VARIANTS[name]
    texts = kernel_ablation.patched(REPO, patches)
    assert texts and all(texts[rel] != (REPO / rel).read_text() for rel in texts)


def test_a_stale_patch_is_named():
    with pytest.raises(ValueError, match=r"no longer applies to csrc/adam_math.h: 'not in the file'"):
        kernel_ablation.patched(REPO, [("csrc/adam_math.h", "not in the file", "x")])
