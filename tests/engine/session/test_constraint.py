"""Constrained decoding: whatever the logits say, the answer follows the schema."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from engine.session.constraint import GrammarError, GrammarMask, json_schema_grammar
from engine.session.prompt_ids import end_of_turn_ids
from tests.engine.tinymodels import make_tiny_model_dir

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["tree", "shrub"]}},
     "required": ["name", "age", "kind"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -1, "maximum": 1}}, "required": ["x"],
        "additionalProperties": False}}, "required": ["inner"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(make_tiny_model_dir(tmp_path_factory.mktemp("grammar"), "llama"))


def decode(tokenizer, schema: dict, seed: int, steps: int = 300) -> str:
    """Greedy over random logits, masked: the mask alone makes the answer valid."""
    ends = end_of_turn_ids(tokenizer)
    mask = GrammarMask(json_schema_grammar(schema), tokenizer, ends)
    rng = np.random.default_rng(seed)
    history, ids = mx.array([0]), []
    for _ in range(steps):
        logits = mx.array(rng.normal(size=(1, len(tokenizer.get_vocab()) + 7))
                          .astype(np.float32))
        token = int(mx.argmax(mask(history, logits), axis=-1).item())
        if token in ends:
            return tokenizer.decode(ids)
        ids.append(token)
        history = mx.array([token])
    raise AssertionError(f"no end after {steps} tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("seed", range(4))
def test_random_logits_masked_give_valid_json(tokenizer, schema: dict, seed: int) -> None:
    jsonschema.validate(json.loads(decode(tokenizer, schema, seed)), schema)


def test_a_schema_it_cannot_take_names_the_part() -> None:
    with pytest.raises(GrammarError, match="nowhere"):
        json_schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})


def test_the_padded_vocabulary_is_never_allowed(tokenizer) -> None:
    mask = GrammarMask(json_schema_grammar({"type": "integer"}), tokenizer,
                       end_of_turn_ids(tokenizer))
    size = len(tokenizer.get_vocab())
    row = mask.allowed(size + 50)
    assert row.shape == (1, size + 50) and not row[0, size:].any().item()
    assert row[0, :size].any().item()
