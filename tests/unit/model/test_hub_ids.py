"""Hub model ids: a config.json is read from the local Hugging Face cache or fetched through
huggingface_hub, never anything else, and each way it can fail says what to do.

The cache is seeded in huggingface_hub's own layout (``models--org--name/refs/main`` naming a
snapshot folder that holds ``config.json``) and read by huggingface_hub itself with
``HF_HUB_OFFLINE=1``, in a subprocess: huggingface_hub reads its cache and offline settings when
it is imported. The Hub itself cannot be reached here, so the answers only the Hub gives (gated,
no such repository) are raised at that one boundary, ``hf_hub_download``, as huggingface_hub's
own exception classes.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_memkit._errors import HfMemkitError
from hf_memkit._model import names

# Qwen2.5-1.5B's published config.json (the fields that size the model)
QWEN15 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
          "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
          "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 131072,
          "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}


def qwen2_params(c: dict) -> int:
    """Qwen2's parameters by hand: q/k/v projections with biases, o without, a SwiGLU MLP, two
    RMSNorms a layer, the embedding, the final norm; the head is tied to the embedding."""
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * c["intermediate_size"] + 2 * h
    return c["vocab_size"] * h + c["num_hidden_layers"] * layer + h


def seed(cache: Path, repo: str, config: dict) -> None:
    """``repo``'s config.json in the local HF cache, laid out as huggingface_hub writes it."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))


def run(code: list[str], cache: Path, *, cli: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    cmd = ([str(Path(sys.executable).parent / "hf-memkit"), *code] if cli
           else [sys.executable, "-c", "\n".join(code)])
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_qwen2_params_by_hand_is_the_published_size():
    assert qwen2_params(QWEN15) == 1_543_714_304   # "1.54B" on the model card


def test_a_hub_id_resolves_from_the_local_cache_offline(tmp_path):
    seed(tmp_path, "Qwen/Qwen2.5-1.5B", QWEN15)
    r = run(["import hf_memkit as mk",
             "print(mk.profile_model('Qwen/Qwen2.5-1.5B').total_params)"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) == qwen2_params(QWEN15)


def test_the_cli_estimates_a_cached_hub_id(tmp_path):
    seed(tmp_path, "Qwen/Qwen2.5-1.5B", QWEN15)
    r = run(["estimate", "Qwen/Qwen2.5-1.5B", "--gpu", "A100-80GB", "--seq-len", "512",
             "--batch", "1", "bf16=true", "--json"], tmp_path, cli=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["verdict"] == "fits"


def test_an_uncached_hub_id_offline_says_how_to_fetch_it(tmp_path):
    r = run(["estimate", "Qwen/Qwen2.5-1.5B", "--gpu", "A100-80GB", "--seq-len", "512",
             "--batch", "1"], tmp_path, cli=True)
    assert r.returncode == 2
    assert "`hf download Qwen/Qwen2.5-1.5B config.json`" in r.stderr
    assert "HF_HUB_OFFLINE" in r.stderr and "Traceback" not in r.stderr


def test_a_cached_config_that_needs_remote_code_is_refused(tmp_path):
    seed(tmp_path, "someone/custom-7b", {"model_type": "custom_arch", "architectures": ["X"],
                                         "auto_map": {"AutoConfig": "configuration_x.XConfig"}})
    r = run(["import hf_memkit as mk", "mk.profile_model('someone/custom-7b')"], tmp_path)
    assert r.returncode != 0 and "never runs a model's code" in r.stderr


@pytest.mark.parametrize(("error", "says"), [
    ("GatedRepoError", "`hf auth login`"),
    ("RepositoryNotFoundError", "has no model of that id"),
    ("RemoteEntryNotFoundError", "has no config.json"),
])
def test_what_the_hub_answers_is_said_with_its_fix(monkeypatch, error, says):
    import huggingface_hub
    from huggingface_hub import errors

    status = {"GatedRepoError": 401, "RepositoryNotFoundError": 404}.get(error, 404)

    def answer(repo_id, filename, **kw):
        cls = getattr(errors, error)
        # the HTTP library huggingface_hub's errors derive from (httpx, or its vendored copy)
        http = importlib.import_module(errors.HfHubHTTPError.__mro__[1].__module__)
        url = f"https://huggingface.co/{repo_id}/resolve/main/{filename}"
        raise cls(f"{error} for {url}",
                  response=http.Response(status, request=http.Request("GET", url)))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", answer)
    with pytest.raises(HfMemkitError, match="meta-llama/Llama-4-Scout") as e:
        names.fetch_config("meta-llama/Llama-4-Scout")
    assert says in str(e.value)


def test_no_suggestion_proposes_another_size():
    assert "Qwen2.5-7B" not in names.model_did_you_mean("Qwen2.5-3B")
    assert "Qwen/Qwen2.5-3B" in names.model_did_you_mean("Qwen2.5-3B")  # its Hub id instead
    assert "bert-large-uncased" not in names.model_did_you_mean("bert-base-cased")
    assert names.model_did_you_mean("Lama-3.1-8B") == " (did you mean `Llama-3.1-8B`?)"
    assert names.model_did_you_mean("llama-3.2-1b") == " (did you mean `Llama-3.2-1B`?)"


def test_no_huggingface_cli_is_named_anywhere():
    """huggingface_hub ships the `hf` command; `huggingface-cli` is gone from it."""
    root = Path(names.__file__).resolve().parents[1]
    hits = [str(p) for p in root.rglob("*.py") if "huggingface-cli" in p.read_text()]
    assert not hits
