"""Recipe values that the run would refuse or crash on are named when the recipe loads (issue
28): SFTTrainer's padding-free rule, a pad_token_id outside the vocabulary, a file that is no
recipe; a recipe's text is still parsed as text (``bf16: 'no'`` is False)."""

from __future__ import annotations

import pytest

import hf_memkit as mk
from hf_memkit._recipe import load_recipe
from tests.helpers import require

HEAD = ("model: Llama-3.2-1B\ntraining: {seq_len: 64, target_batch_size: 8}\n"
        "hardware: {device: A100-80GB}\n")


def test_padding_free_without_max_length_none_is_refused_in_an_sft_recipe(tmp_path):
    require("trl")
    p = tmp_path / "r.yaml"
    p.write_text(HEAD + "trainer: sft\npins: {padding_free: true}\n")
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    assert ei.value.problems == [
        f"{p}: pins: padding_free=True without packing needs max_length=None, got "
        "max_length=1024: SFTTrainer refuses it (without packing it does not truncate the "
        "rows, so max_length is not enforced). Set max_length=None and truncate the rows "
        "beforehand, or pack them (packing=True)"]
    p.write_text(HEAD + "trainer: sft\npins: {padding_free: 'true', max_length: null}\n")
    assert load_recipe(p).pins == {"padding_free": True, "max_length": None}


def test_a_pad_token_id_outside_the_vocabulary_is_named_at_load(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(HEAD.replace("model: Llama-3.2-1B",
                              "model: {name: Llama-3.2-1B, overrides: {pad_token_id: 128256}}"))
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    assert ei.value.problems == [
        f"{p}: model.overrides: pad_token_id=128256 is outside the vocabulary "
        "(vocab_size=128256): the embedding cannot pad with it; set pad_token_id to a token id "
        "in [0, 128256), e.g. the eos_token_id 128001, or None, or raise vocab_size to cover "
        "it"]


def test_a_yaml_mapping_with_no_recipe_key_is_not_a_recipe(tmp_path):
    p = tmp_path / "passwd"
    p.write_text("root:x:0:0:root:/root:/bin/bash:\nbin:x:1:1:bin:/bin:/sbin/nologin:\n")
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    assert len(ei.value.problems) == 1 and "not a recipe" in ei.value.problems[0]
    assert "/bin/bash" not in str(ei.value) and "nologin" not in str(ei.value)


def test_a_recipe_path_that_is_not_a_file_says_what_it_is(tmp_path):
    import os

    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for path, words in ((tmp_path / "folder", "is a directory"),
                        (tmp_path / "pipe", "is a FIFO (named pipe)"),
                        ("/dev/zero", "is a device"),
                        (tmp_path / "link", "is a broken symbolic link")):
        with pytest.raises(mk.ConfigError) as err:
            load_recipe(path)
        msg = str(err.value)
        assert words in msg and "give a recipe .yaml file" in msg and "no such file" not in msg
