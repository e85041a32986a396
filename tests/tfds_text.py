"""A TFDS text dataset as a --dataset loader: its text records joined by newlines, read as bytes
(vocabulary 256), its validation (or test) split held out. The name after the colon is the TFDS
dataset's; its text is the feature named `text`, or its only text feature. Prepare it once
(TensorFlow is needed for that only), then train with any script:

  python tools/check.py --dataset tests/tfds_text.py:tiny_shakespeare --data-dir ~/tfds
  python fsdp.py --dataset tests/tfds_text.py:tiny_shakespeare --data-dir ~/tfds

Offline, put the files TFDS downloads in DATA_DIR/downloads/manual (TFDS's manual folder).
"""

import os

import tensorflow_datasets as tfds

import common

TENSORFLOW = "tensorflow-cpu==2.21.0"  # what preparing a TFDS catalogue dataset imports


def __getattr__(name: str):
    """--dataset tests/tfds_text.py:NAME: the load(config) of TFDS's dataset NAME."""
    if name.startswith("__"):
        raise AttributeError(name)
    return load


def _builder(config, **options):
    name, eg = config.dataset.partition(":")[2], "e.g. --dataset tests/tfds_text.py:tiny_text"
    common.require(name, "dataset", f"{config.dataset} names no TFDS dataset after a colon, {eg}")
    try:
        return tfds.builder(name, data_dir=config.data_dir, **options)
    except (tfds.core.registered.DatasetNotFoundError, ValueError):  # ValueError: no name's form
        no = f"{name} is neither in TFDS's catalogue nor prepared in --data-dir {config.data_dir}"
        raise common.ConfigError(f"--dataset {no}, e.g. --dataset synthetic") from None


def text_feature(name: str, features: dict) -> str:
    """The feature holding the text: `text`, or the only text feature."""
    texts = [k for k, f in features.items() if isinstance(f, tfds.features.Text)]
    found = "text" if "text" in features else texts[0] if len(texts) == 1 else None
    has = f"has text features {', '.join(texts)}" if texts else "has no text feature"
    common.require(found, "dataset", f"{name} {has}: name one `text` (tests/tfds_text.py)")
    return found


def load(config):
    """The dataset, prepared in --data-dir, as common.TextFile reads text."""
    made = _builder(config)
    name, key = made.name, text_feature(made.name, made.info.features)
    how = f"python tools/check.py --dataset {config.dataset} --data-dir DIR"
    common.require(made.is_prepared(), "dataset", f"{name} is not prepared: {how}")
    held_out = "validation" if "validation" in made.info.splits else "test"

    def read(split):
        records = tfds.data_source(name, split=split, data_dir=config.data_dir, download=False)
        return b"\n".join(records[i][key] for i in range(len(records)))

    about = f"TFDS {made.info.full_name} '{key}' as bytes, held out: {held_out}"
    return common.TextFile(config, {"train": read("train"), "eval": read(held_out)}, about)


def prepare(config):
    """Download and convert the dataset into --data-dir (tools/check.py calls this)."""
    made, problem = _builder(config, file_format="array_record"), None
    if made.is_prepared():
        return
    manual = os.path.join(made.data_dir_root, "downloads", "manual")
    files = {i.filename or u.rsplit("/", 1)[-1]: u for u, i in (made.url_infos or {}).items()}
    missing = [f for f in files if not os.path.exists(os.path.join(manual, f))]
    if os.path.isdir(manual) and missing and len(missing) == len(files):
        problem = f"{manual} holds no {', '.join(missing)}: download {', '.join(files.values())}"
    common.require(not problem, "dataset", f"{made.name}: {problem}")
    try:  # TFDS's catalogue builders write through TensorFlow; reading later does not need it
        import tensorflow as tf
    except ImportError:
        why = f'preparing it needs TensorFlow: pip install "{TENSORFLOW}"'
        raise common.ConfigError(f"--dataset {made.name}: {why}") from None
    tf.config.set_visible_devices([], "GPU")  # leave the GPUs to JAX
    print(f"preparing TFDS {made.name} in {made.data_dir}", flush=True)
    try:
        made.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual))
    except Exception as error:  # no network, a bad manual file, ...
        failed = f"preparing it failed ({' '.join(str(error).split())[:300]})"
        raise common.ConfigError(
            f"--dataset {made.name}: {failed}; prepare it online or put its files in {manual}"
        ) from None
