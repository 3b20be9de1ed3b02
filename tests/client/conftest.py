from __future__ import annotations

import pytest

from tests.checkpoints import save_hf_checkpoint


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return save_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", initializer_range=0.1)
