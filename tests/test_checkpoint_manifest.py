"""The manifest (fzero.checkpoint.manifest, fzero.checkpoint.strict_json): its contents, strict
JSON, every value validated and named on load, and refused by save as load would refuse it."""
import json
import os
import re

import optree
import pytest
import torch
from safetensors.torch import load_file

import fzero
from fzero import checkpoint as ck
from fzero import transforms
from fzero.checkpoint import commit
from fzero.checkpoint.strict_json import MAX_DEPTH
from helpers import CKPT_ONE, ckpt_entries, ckpt_fresh_engine, edit_manifest, grads_like, odd_params, snapshot_dir


def test_manifest_contents_and_no_pickle(saved):
    path, engine, params, state, ss = saved
    m = ck.read_manifest(path)
    assert m["format"] == "fzero-checkpoint" and m["version"] == ck.VERSION == 2 and m["world_size"] == 1
    assert m["param_dtype"] == "float16" and m["step"] is None  # extra has no "step"
    assert [(e["path"], e["shape"], e["offset"]) for e in m["layout"]["leaves"]] == [
        ("blocks/0/g", [13], 0), ("blocks/1/g", [3, 1, 2], 13), ("one", [1], 19), ("w", [7, 5], 20), ("z", [17, 23], 55)]
    scalars = {e["name"]: e["value"] for e in m["state"] if e["kind"] == "scalar"}
    assert scalars["tx_state/0/b2"] == 0.999 and scalars["tx_state/1/inner/weight_decay"] == 0.1
    assert m["loss_scale"]["scale"] == float(ss.scale) and m["extra"] == {"epoch": 1, "seen": [1, 2]}
    (entry,) = m["files"]
    assert entry["segments"] == [[0, 446]] and len(entry["sha256"]) == 64
    tensors = load_file(os.path.join(snapshot_dir(path), entry["file"]))
    assert sorted(tensors) == ["master", "tx_state/0/mu", "tx_state/0/nu", "tx_state/1/mask"]
    assert tensors["tx_state/1/mask"].dtype == torch.bool and tensors["master"].shape == (446,)  # no padding


def test_manifest_step_is_extras_step(saved, tmp_path):
    path, engine, params, state, ss = saved
    ck.save(path, params, state, ss, engine, extra={"step": 7, "seed": 1})
    assert ck.read_manifest(path)["step"] == 7  # not the optimizer's count (2: one step was skipped)
    assert int(state.tx_state[0].count) == 2
    for bad in (-1, 2.0, True, "7", None):
        with pytest.raises(ck.CheckpointError, match=r"extra\['step'\] = .*: must be an integer >= 0"):
            ck.save(path, params, state, ss, engine, extra={"step": bad})
    assert ck.read_manifest(path)["step"] == 7  # the refused saves committed nothing


def edit_fields(path, change):
    """``change(manifest)`` on the parsed manifest, written back (see ``edit_manifest``)."""
    def edit(text):
        m = json.loads(text)
        change(m)
        return json.dumps(m, indent=1)

    edit_manifest(path, edit)


def set_scalar(name, value):
    def change(m):
        (entry,) = [e for e in m["state"] if e["name"] == name]
        entry["value"] = value

    return change


def set_at(value, *keys):
    def change(m):
        for k in keys[:-1]:
            m = m[k]
        m[keys[-1]] = value

    return change


def add_scalar(name, value, dtype="float64"):
    return lambda m: m["state"].append({"name": name, "kind": "scalar", "dtype": dtype, "value": value})


BAD_MANIFESTS = {
    "b2 >= 1": (set_scalar("tx_state/0/b2", 1.5), r"state\['tx_state/0/b2'\]\.value = 1\.5: must be in \[0, 1\)"),
    "b1 < 0": (set_scalar("tx_state/0/b1", -0.1), r"state\['tx_state/0/b1'\]\.value = -0\.1: must be in \[0, 1\)"),
    "b2 nan": (set_scalar("tx_state/0/b2", "nan"), r"state\['tx_state/0/b2'\]\.value = 'nan': must be in \[0, 1\)"),
    "eps < 0": (set_scalar("tx_state/0/eps", -1e-8), r"state\['tx_state/0/eps'\]\.value = -1e-08: must be a finite number >= 0"),
    "weight decay inf": (set_scalar("tx_state/1/inner/weight_decay", "inf"),
                         r"state\['tx_state/1/inner/weight_decay'\]\.value = 'inf': must be a finite number >= 0"),
    "lr < 0": (add_scalar("tx_state/3/lr", -1.0), r"state\['tx_state/3/lr'\]\.value = -1\.0: must be a finite number >= 0"),
    "max_norm 0": (add_scalar("tx_state/3/max_norm", 0.0), r"state\['tx_state/3/max_norm'\]\.value = 0\.0: must be a finite number > 0"),
    "max_norm inf": (add_scalar("tx_state/3/max_norm", "inf"), r"state\['tx_state/3/max_norm'\]\.value = 'inf': must be a finite number > 0"),
    "momentum < 0": (add_scalar("tx_state/3/momentum", -0.5), r"state\['tx_state/3/momentum'\]\.value = -0\.5: must be a finite number >= 0"),
    "count < 0": (set_scalar("tx_state/0/count", -1), r"state\['tx_state/0/count'\]\.value = -1: must be a non-negative integer"),
    "count float": (set_scalar("tx_state/0/count", 2.5), r"state\['tx_state/0/count'\]\.value = 2\.5: must be an integer \(an int32 leaf\)"),
    "count list": (set_scalar("tx_state/2/count", [2]), r"state\['tx_state/2/count'\]\.value = \[2\]: must be an integer"),
    "count too big": (set_scalar("tx_state/2/count", 2**40), r"state\['tx_state/2/count'\]\.value = 1099511627776: must be in the int32 range"),
    "hyperparameter dict": (set_scalar("tx_state/0/b2", {"v": 0.9}), r"state\['tx_state/0/b2'\]\.value = \{'v': 0\.9\}: must be a number"),
    "hyperparameter string": (set_scalar("tx_state/0/b2", "0.9"), r"state\['tx_state/0/b2'\]\.value = '0\.9': must be a number"),
    "unknown dtype": (lambda m: m["state"][0].update(dtype="float128"), r"state\['master'\]\.dtype = 'float128': must be one of"),
    "duplicate leaf": (lambda m: m["state"].append(dict(m["state"][0])), r"state\[\d+\]\.name = 'master': must be unique"),
    "kind": (lambda m: m["state"][0].update(kind="blob"), r"state\['master'\]\.kind = 'blob': must be one of"),
    "scale nan": (set_at("nan", "loss_scale", "scale"), r"loss_scale\.scale = 'nan': must be a finite number > 0"),
    "scale 0": (set_at(0, "loss_scale", "scale"), r"loss_scale\.scale = 0: must be a finite number > 0"),
    "scale above max_scale": (set_at(2.0**30, "loss_scale", "scale"),
                              r"loss_scale\.scale = 1073741824\.0: must be in \[min_scale, max_scale\] = \[1\.0, 16777216\.0\]"),
    "scale below min_scale": (set_at(0.5, "loss_scale", "scale"), r"loss_scale\.scale = 0\.5: must be in \[min_scale"),
    "good_steps < 0": (set_at(-1, "loss_scale", "good_steps"), r"loss_scale\.good_steps = -1: must be in \[0, 2147483647\]"),
    "hysteresis float": (set_at(1.0, "loss_scale", "hysteresis"), r"loss_scale\.hysteresis = 1\.0: must be an integer"),
    "stuck_steps bool": (set_at(True, "loss_scale", "stuck_steps"), r"loss_scale\.stuck_steps = True: must be an integer"),
    "param dtype": (set_at("int8", "param_dtype"), r"param_dtype = 'int8': must be one of"),
    "bytes string": (lambda m: m["files"][0].update(bytes="1234"), r"files\[0\]\.bytes = '1234': must be an integer"),
    "bytes bool": (lambda m: m["files"][0].update(bytes=True), r"files\[0\]\.bytes = True: must be an integer"),
    "segment float": (lambda m: m["files"][0].update(segments=[[0, 446.0]]), r"files\[0\]\.segments\[0\]\[1\] = 446\.0: must be an integer"),
    "segment gap": (lambda m: m["files"][0].update(segments=[[0, 400]]), r"files\[\*\]\.segments = 400: .* cover all 446"),
    "file name": (lambda m: m["files"][0].update(file="../x.safetensors"), r"files\[0\]\.file = '\.\./x\.safetensors': must be a plain"),
    "sha256": (lambda m: m["files"][0].update(sha256="abc"), r"files\[0\]\.sha256 = 'abc': must match"),
    "shape float": (lambda m: m["layout"]["leaves"][0].update(shape=[13.0]), r"layout\.leaves\[0\]\.shape\[0\] = 13\.0: must be an integer"),
    "numel": (set_at(445, "layout", "numel"), r"layout\.numel = 445: must be 446"),
    "world size": (set_at(0, "world_size"), r"world_size = 0: must be >= 1"),
    "step": (set_at(-3, "step"), r"step = -3: must be >= 0"),
    "step without extra.step": (set_at(7, "step"), r"step = 7: must be extra\.step \(None\), as a save writes it"),
    "extra.step string": (lambda m: m.update(step=7, extra={"step": "7"}), r"extra\.step = '7': must be an integer"),
    "extra.step other": (lambda m: m.update(step=7, extra={"step": 8}), r"step = 7: must be extra\.step \(8\)"),
    "extra": (set_at([1], "extra"), r"extra = \[1\]: must be a JSON object"),
    "missing field": (lambda m: m.pop("files"), r"files is missing"),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_manifest_values_are_validated_and_named(saved, case):
    path, *_ = saved
    change, want = BAD_MANIFESTS[case]
    ck.load(path, ckpt_fresh_engine())  # as saved: fine
    edit_fields(path, change)
    with pytest.raises(ck.CheckpointError, match=r"manifest\.json: manifest field " + want):
        ck.load(path, ckpt_fresh_engine())


@pytest.mark.parametrize("token,want", [
    ("NaN", "non-standard JSON token NaN"),
    ("-Infinity", "non-standard JSON token -Infinity"),
    ("1e400", "number 1e400 is out of the float64 range"),
])
def test_manifest_is_parsed_as_strict_json(saved, token, want):
    path, *_ = saved
    edit_manifest(path, lambda text: re.sub(r'"value": 0\.999\b', f'"value": {token}', text, count=1))
    for read in (lambda: ck.load(path, ckpt_fresh_engine()), lambda: ck.read_manifest(path)):
        with pytest.raises(ck.CheckpointError, match=rf"cannot read .*manifest\.json: {want}"):
            read()


def test_manifest_with_a_duplicate_key_is_refused(saved):
    path, *_ = saved
    edit_manifest(path, lambda text: text.replace('"format": "fzero-checkpoint",', '"format": "fzero-checkpoint", "step": 1,', 1))
    with pytest.raises(ck.CheckpointError, match=r"cannot read .*manifest\.json: duplicate key 'step'"):
        ck.load(path, ckpt_fresh_engine())


def test_save_refuses_what_load_would_refuse(saved):
    path, engine, params, state, ss = saved
    for extra, want in [({"hist": [1.0, float("nan")]}, r"extra\['hist'\]\[1\] = nan"),
                        ({"best": {"loss": float("-inf")}}, r"extra\['best'\]\['loss'\] = -inf")]:
        with pytest.raises(ck.CheckpointError, match=want + ": JSON has no NaN or infinity"):
            ck.save(path, params, state, ss, engine, extra=extra)
    adam = state.tx_state[0]._replace(b2=torch.tensor(1.5, dtype=torch.float64))
    bad = state._replace(tx_state=(adam, *state.tx_state[1:]))
    with pytest.raises(ck.CheckpointError, match=r"manifest field state\['tx_state/0/b2'\]\.value = 1\.5: must be in \[0, 1\)"):
        ck.save(path, params, bad, ss, engine)
    # nothing was committed, no snapshot left behind
    assert ckpt_entries(path) == CKPT_ONE
    assert ck.load(path, ckpt_fresh_engine())[3] == {"epoch": 1, "seen": [1, 2]}


def nested(depth):
    """A list nested ``depth`` deep (``[[]]`` is 2), built without recursion."""
    x = []
    for _ in range(depth - 1):
        x = [x]
    return x


def test_json_nested_too_deep_is_refused_naming_the_file(saved):
    """Checked before parsing: a crafted manifest or pointer nested 200,000 deep is one
    CheckpointError naming the file (never a RecursionError); save refuses an ``extra`` that
    would nest the manifest deeper than a load reads, and keeps one that does not."""
    path, engine, params, state, ss = saved
    deep = "[" * 200_000 + "]" * 200_000
    edit_manifest(path, lambda text: text.replace('"extra": {', f'"extra": {{"deep": {deep}, ', 1))
    name = os.path.basename(snapshot_dir(path))
    for read in (lambda: ck.read_manifest(path), lambda: ck.load(path, ckpt_fresh_engine()), lambda: ck.recover(path, name)):
        with pytest.raises(ck.CheckpointError, match=rf"cannot read .*/{name}/manifest\.json: arrays or objects nested "
                                                     rf"more than {MAX_DEPTH} deep"):
            read()
    with open(os.path.join(path, commit.POINTER), "w") as f:
        f.write("{" + '"a":{' * 200_000 + "}" * 200_001)
    with pytest.raises(ck.CheckpointError, match=rf"current\.json is damaged \(cannot read .*current\.json: arrays or "
                                                 rf"objects nested more than {MAX_DEPTH} deep"):
        ck.read_manifest(path)

    fresh = str(os.path.join(os.path.dirname(path), "fresh"))
    for depth in (MAX_DEPTH, 5000, 200_000):  # extra nests depth deep, the manifest one more; deeper than Python recurses
        with pytest.raises(ck.CheckpointError, match=rf"extra nests lists or dicts more than {MAX_DEPTH - 1} deep"):
            ck.save(fresh, params, state, ss, engine, extra={"d": nested(depth - 1)})
    assert not os.path.exists(fresh)  # refused before anything was written
    ck.save(fresh, params, state, ss, engine, extra={"d": nested(MAX_DEPTH - 2)})  # the manifest: MAX_DEPTH deep
    assert ck.load(fresh, ckpt_fresh_engine())[3] == {"d": nested(MAX_DEPTH - 2)}


@pytest.fixture
def adafactor_saved(tmp_path):
    """A checkpoint of an Adafactor engine after 2 steps: ``(path, engine, state)``."""
    engine = fzero.zero1(transforms.adafactor(), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = engine.init(odd_params())
    for s in range(2):
        params, state, ss, _ = engine.step(params, grads_like(odd_params(), s), state, ss)
    path = str(tmp_path / "ckpt")
    ck.save(path, params, state, ss, engine)
    return path, engine, state


def test_statistics_every_rank_holds_alike_are_stored_once_whole_with_their_shapes_and_exported(adafactor_saved):
    path, engine, state = adafactor_saved
    m = ck.read_manifest(path)
    stats = {e["name"]: e["shape"] for e in m["state"] if e["kind"] == "replicated"}
    prefix = "tx_state/moments/inner_states/factored"
    assert stats == {f"{prefix}/0/row": [3, 1, 1], f"{prefix}/0/col": [3, 1, 2], f"{prefix}/1/row": [7, 1],
                     f"{prefix}/1/col": [1, 5]}
    tensors = load_file(os.path.join(snapshot_dir(path), m["files"][0]["file"]))
    assert torch.equal(tensors[f"{prefix}/1/row"], state.tx_state.moments.inner_states["factored"][1].row.reshape(-1))
    fresh = fzero.zero1(transforms.adafactor(), param_dtype=torch.float32, loss_scale=None)
    fresh.init(odd_params())
    _, loaded, _, _ = ck.load(path, fresh)
    for a, b in zip(optree.tree_leaves(loaded.tx_state), optree.tree_leaves(state.tx_state), strict=True):
        assert torch.equal(a, b)
    ck.export_full(os.path.join(path, "..", "full.safetensors"), state, engine, moments=True)  # by path, whole
    exported = load_file(os.path.join(path, "..", "full.safetensors"))
    assert torch.equal(exported[f"{prefix}/0/col"], state.tx_state.moments.inner_states["factored"][0].col)


@pytest.mark.parametrize("change, want", [
    (lambda e: e.update(shape=[7, 2]), r"state leaf '.*factored/1/row' has shape \[7, 2\] in the checkpoint but \[7, 1\] here"),
    (lambda e: e.update(shape=[7.0, 1]), r"manifest field state\['.*factored/1/row'\]\.shape\[0\] = 7\.0: must be an integer"),
    (lambda e: e.pop("shape"), r"manifest field state\['.*factored/1/row'\]\.shape is missing"),
])
def test_a_statistics_shape_is_validated_and_named(adafactor_saved, change, want):
    path, engine, _ = adafactor_saved

    def edit(m):
        change(next(e for e in m["state"] if e["name"].endswith("factored/1/row")))

    edit_fields(path, edit)
    fresh = fzero.zero1(transforms.adafactor(), param_dtype=torch.float32, loss_scale=None)
    fresh.init(odd_params())
    with pytest.raises(ck.CheckpointError, match=want):
        ck.load(path, fresh)
