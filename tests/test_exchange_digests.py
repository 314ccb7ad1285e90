"""Every compressor and topology gives, after 50 steps, the parameters and byte counts recorded before the
exchange was rebuilt on schemes (tests/data/exchange_digests.json): simulated and on 4 gloo workers."""

from __future__ import annotations

import json

import pytest
from exchange_digests import CONFIGS, DIGEST_FILE, real, simulated

RECORDED = json.loads(DIGEST_FILE.read_text())


@pytest.fixture(scope="module")
def gloo_now():
    return real()


def test_every_config_was_recorded():
    assert set(RECORDED["simulated"]) == set(CONFIGS) == set(RECORDED["gloo"])


@pytest.mark.parametrize("label", list(CONFIGS))
def test_simulated_digest_unchanged(label):
    assert simulated([label])[label] == RECORDED["simulated"][label]


@pytest.mark.slow
@pytest.mark.parametrize("label", list(CONFIGS))
def test_gloo_digest_unchanged(gloo_now, label):
    assert gloo_now[label] == RECORDED["gloo"][label]
