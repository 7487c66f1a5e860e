"""KLUE in ``bertpipe evaluate``: ``suite=klue`` on files in KLUE's release layout (written by
:mod:`tests.finetuning.klue_layout`: Korean rows, a tiny cased BERT with their syllables),
KLUE's metrics as its baseline code defines them, character labels through the tokenizer's
offsets, and one line with exit 2 for a bad row or a label the training file lacks in every
task.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bertpipe.finetuning.tasks import klue
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri
from tests.finetuning.klue_layout import korean_vocab, ner_chars, task_files, write_klue

TASKS = ["ynat", "sts", "nli", "ner", "mrc"]
PROTOCOL = [
    "protocol.learning_rates=[1e-3]",
    "protocol.seeds=[1]",
    "protocol.epochs=1",
    "protocol.batch_size=4",
    "protocol.max_seq_length=128",
    "threads_per_trial=1",
    "parallel=1",
    "tracking.experiment=klue",
]


def _env() -> dict[str, str]:
    job = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in job}, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def korean_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny cased BERT exported like ``bertpipe export`` does, its vocabulary the test
    rows' Hangul syllables (whole and as ``##`` pieces) and a few whole words."""
    from bertpipe.preprocessing.tokenizer import build_from_vocab, save_tokenizer
    from bertpipe.training.models.bert.model import BertForPreTraining, BertModelConfig
    from bertpipe.training.models.hf import save_hf_folder

    folder = tmp_path_factory.mktemp("korean-bert")
    tokenizer = build_from_vocab(korean_vocab(), lowercase=False)
    save_tokenizer(tokenizer, str(folder), lowercase=False)
    torch.manual_seed(0)
    cfg = BertModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        max_position_embeddings=128,
    )
    extra = {n: (folder / n).read_bytes() for n in ("vocab.txt", "tokenizer.json")}
    save_hf_folder(BertForPreTraining(cfg), folder, extra_files=extra)
    return folder


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_klue(tmp_path / "klue_benchmark")


# --------------------------------------------------------------------------- readers


def test_readers_take_the_release_layout(data: Path) -> None:
    files = task_files(data)
    ynat, report = klue.read_klue_pairs("ynat", files["ynat"]["train"])
    assert len(ynat) == 14 and report.problems == []
    assert {klue.YNAT_LABELS[int(e.label)] for e in ynat} == set(klue.YNAT_LABELS)
    assert ynat[0].text_a == "국회 본회의 예산안 통과" and ynat[0].text_b is None
    sts, _ = klue.read_klue_pairs("klue-sts", files["sts"]["dev"])
    assert [e.label for e in sts] == [0.4, 3.4, 0.0, 1.8]  # labels.real-label
    assert sts[0].guid == "klue-sts-v1.1_dev_00000" and sts[0].line == 3
    nli, _ = klue.read_klue_pairs("nli", files["nli"]["dev"])
    assert [klue.NLI_LABELS[int(e.label)] for e in nli] == [
        "entailment",
        "contradiction",
        "neutral",
    ]
    ner, report = klue.read_klue_ner(files["ner"]["train"])
    assert len(ner) == 6 and report.problems == []
    first = ner[0]
    assert first.guid == "klue-ner-v1.1_train_00000" and first.line == 7  # after 6 comments
    assert first.text == "김철수는 서울에서 일했다." and first.labels[:3] == (
        "B-PS",
        "I-PS",
        "I-PS",
    )
    assert ner[2].labels[:5] == ("B-LC", "I-LC", "I-LC", "I-LC", "I-LC")  # 서울 시청: a space
    mrc, report = klue.read_klue_mrc(files["mrc"]["dev"])
    assert [e.qid for e in mrc][:2] == ["klue-mrc-v1.1_dev_00000_0", "klue-mrc-v1.1_dev_00000_1"]
    assert [e.is_impossible for e in mrc] == [False, False, False, True]
    assert report.problems == []


def test_ner_characters_reach_word_pieces_and_come_back(korean_bert: Path, data: Path) -> None:
    """Every token is labelled with its first character's tag through the tokenizer's
    offsets; the gold token labels, aligned back, give every character its tag (spaces
    aside, which KLUE does not score), and KLUE's two scores are 1."""
    from bertpipe.preprocessing.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(korean_bert))
    sentences, _ = klue.read_klue_ner(task_files(data)["ner"]["train"])
    spec = klue.klue_task("ner").spec
    features = klue.featurize_klue_ner(tokenizer, sentences, spec, 64)
    tokens = tokenizer.encode(sentences[0].text, add_special_tokens=False).tokens
    assert tokens[:3] == ["김철수", "##는", "서울"]  # pieces of several syllables
    assert features["labels"][0, 1:4].tolist() == [spec.label_to_id[t] for t in ("B-PS", "O")] + [
        spec.label_to_id["B-LC"]
    ]
    gold_ids = np.where(features["labels"] < 0, 0, features["labels"])
    aligned = klue.align_klue_ner(features, gold_ids, sentences, spec)
    for sentence, tags in zip(sentences, aligned, strict=True):
        for ch, want, got in zip(sentence.chars, sentence.labels, tags, strict=True):
            assert ch == " " or got == want, (sentence.text, ch, want, got)
    assert klue.klue_ner_metrics(sentences, aligned) == {
        "entity_macro_f1": 1.0,
        "character_macro_f1": 1.0,
    }
    truncated = klue.featurize_klue_ner(tokenizer, sentences, spec, 8)
    assert truncated["truncated"].all()
    cut = klue.align_klue_ner(truncated, np.zeros((6, 8), dtype=int), sentences, spec)
    assert cut[0][-1] == "O"  # a character past the cut is O


def test_ner_offsets_hold_through_an_uncased_normaliser() -> None:
    """An uncased tokenizer lower-cases and strips accents; its offsets still point into
    the sentence as written, so every character gets its tag back: ``É`` written as one
    character, and written decomposed (``E`` and a combining accent on lines of their own,
    the accent covered by no token: it goes with the character before it)."""
    import unicodedata

    from bertpipe.preprocessing.tokenizer import build_from_vocab

    tokenizer = build_from_vocab([*korean_vocab(), "cafe"], lowercase=True)
    marked = [
        "<CAFÉ 서울:OG>에서 <김철수:PS>를 만났다.",
        "<" + unicodedata.normalize("NFD", "CAFÉ") + ":OG> 부산에서",
    ]
    sentences = []
    for i, text in enumerate(marked):
        chars, tags = zip(*ner_chars(text), strict=True)
        sentences.append(klue.KlueSentence(f"s{i}", chars, tags, 1))
    assert len(sentences[1].chars) == len(sentences[0].chars[:4]) + 1 + 5  # the accent
    spec = klue.klue_task("ner").spec
    features = klue.featurize_klue_ner(tokenizer, sentences, spec, 64)
    gold_ids = np.where(features["labels"] < 0, 0, features["labels"])
    aligned = klue.align_klue_ner(features, gold_ids, sentences, spec)
    for sentence, tags in zip(sentences, aligned, strict=True):
        for ch, want, got in zip(sentence.chars, sentence.labels, tags, strict=True):
            assert ch == " " or got == want, (sentence.text, ch, want, got)


def test_ner_metrics_are_klues_definitions() -> None:
    """Entity macro F1: seqeval strict IOB2 (an entity opened with I- is none), the mean
    over types; character macro F1: scikit-learn over all 13 tags, a tag on neither side
    1.0. Spaces are not scored."""
    sentence = klue.KlueSentence("g", tuple("김철수 서울"), tuple(t for _, t in ner_chars(
        "<김철수:PS> <서울:LC>"
    )), 1)  # fmt: skip
    predicted = ["I-PS", "I-PS", "I-PS", "O", "B-LC", "I-LC"]
    scores = klue.klue_ner_metrics([sentence], [predicted])
    # PS: predicted I-PS I-PS I-PS is no entity in strict IOB2 -> F1 0; LC: 1 -> mean 0.5
    assert scores["entity_macro_f1"] == pytest.approx(0.5)
    # per tag: B-PS 0 (1 gold, 0 predicted), I-PS 2*2/(2+3)=0.8, B-LC 1, I-LC 1, O 0/0
    # (no O outside the space) -> 1, 8 tags on neither side -> 1 each: (0 + 0.8 + 11) / 13
    assert scores["character_macro_f1"] == pytest.approx((0.8 + 11) / 13)


def test_mrc_metrics_are_klues_definitions() -> None:
    """EM after KLUE's normalisation (lower case, ASCII punctuation out, no articles, no
    Unicode punctuation) and KLUE's "ROUGE-W": the F1 of the longest common contiguous
    substring, in characters; an unanswerable question's answer is the empty string."""
    assert klue.normalize_klue_answer("  The 「서울」.  시청 ") == "the 「서울」 시청"
    assert klue.rouge_w("서울특별시", "서울") == pytest.approx(2 * 0.4 * 1 / 1.4)
    assert klue.rouge_w("서울시청", "시청역") == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    assert klue.rouge_w("", "") == 1.0 and klue.rouge_w("서울", "") == 0.0
    scores = klue.klue_mrc_metrics(
        {"a": "서울.", "b": "서울특별시", "c": "", "d": "부산"},
        {"a": ["서울"], "b": ["부산", "서울"], "c": [], "d": []},
    )
    assert scores["exact_match"] == pytest.approx(2 / 4)  # a (punctuation), c (no answer)
    assert scores["rouge_w"] == pytest.approx((1 + 2 * 0.4 / 1.4 + 1 + 0) / 4)


def test_squad_answers_in_other_languages_follow_mlqa() -> None:
    """SQuAD's official normalisation stays for English; other languages get MLQA's: Unicode
    punctuation out, each CJK character a token (partial credit in Chinese and Japanese),
    Korean split at its spaces."""
    from bertpipe.finetuning.tasks.squad_scores import f1_score, normalize_answer, squad_metrics

    assert normalize_answer("The Cat。") == "cat。"  # the official script, exactly
    assert normalize_answer("「東京都」。", "ja") == "東 京 都"
    assert f1_score("東京都", "東京", "zh") == pytest.approx(0.8)
    assert f1_score("東京都", "東京") == 0.0  # one whitespace token each in the official one
    assert f1_score("서울 특별시", "서울", "ko") == pytest.approx(2 / 3)
    assert squad_metrics({"q": "北京大学。"}, {"q": ["北京大学"]}, "zh")["exact"] == 100.0
    assert squad_metrics({"q": "北京大学。"}, {"q": ["北京大学"]})["exact"] == 0.0


# --------------------------------------------------------------------------- the suite


def test_suite_finds_the_release_folders(data: Path, tmp_path: Path) -> None:
    """The task folders present, in KLUE's order, v1.1 or else v1; MRC gets SQuAD's 384
    tokens by default; a task folder without its dev file, or a folder with no KLUE task,
    is one line."""
    from bertpipe.config import ConfigError
    from bertpipe.finetuning.evaluation.suite import load_suite, seq_length
    from bertpipe.finetuning.tasks.base import TaskDataError

    suite = load_suite("klue", str(data))
    assert [t.name for t in suite.tasks] == TASKS
    assert [seq_length(t) for t in suite.tasks] == [128, 128, 128, 128, 384]
    ner = suite.tasks[3].task
    assert ner["train"].endswith("klue-ner-v1.1/klue-ner-v1.1_train.tsv")
    old = data / "klue-nli-v1"  # the first release's names
    old.mkdir()
    for split in ("train", "dev"):
        (data / "klue-nli-v1.1" / f"klue-nli-v1.1_{split}.json").rename(
            old / f"klue-nli-v1_{split}.json"
        )
    (data / "klue-nli-v1.1").rmdir()
    found = load_suite("klue", str(data), ["nli"]).tasks[0].task
    assert found["dev"] == [str(old / "klue-nli-v1_dev.json")]
    (data / "ynat-v1.1" / "ynat-v1.1_dev.json").unlink()
    with pytest.raises(TaskDataError, match=r"ynat-v1\.1_dev\.json is missing"):
        load_suite("klue", str(data))
    with pytest.raises(ConfigError, match="holds no task of the klue suite"):
        load_suite("klue", str(tmp_path))


def test_suite_klue_runs_every_task(korean_bert: Path, data: Path, tmp_path: Path) -> None:
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    out = tmp_path / "out"
    args = ["evaluate", f"model={korean_bert}", "suite=klue", f"data={data}", f"output={out}"]
    done = run_cli([*args, *PROTOCOL, f"tracking.uri={uri}"], _env())
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["suite"] == "klue" and list(summary["tasks"]) == TASKS
    for task in TASKS:  # fractions (STS's Pearson may be below 0)
        assert -1.0 <= summary["tasks"][task]["score"] <= 1.0, summary
    results = json.loads((out / "results.json").read_text())
    metrics = {t["task"]: t["metrics"] for t in results["scores"]["tasks"]}
    assert set(metrics["ner"]) == {"entity_macro_f1", "character_macro_f1"}
    assert set(metrics["sts"]) == {"pearson", "f1"} and set(metrics["mrc"]) == {
        "exact_match",
        "rouge_w",
    }
    assert set(metrics["ynat"]) == {"macro_f1"} and set(metrics["nli"]) == {"accuracy"}
    run = mlflow.MlflowClient(uri).get_run(summary["run_id"])
    assert run.data.tags["bertpipe.suite"] == "klue"
    assert run.data.tags["bertpipe.suite_tasks"] == ",".join(TASKS)
    ner_predictions = next((out / "trials").rglob("predictions/epoch1/*/*.tsv"))
    lines = ner_predictions.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "## klue-ner-v1.1_dev_00000" and lines[1].startswith("김\tB-PS\t")


def _edit_json(path: Path, change: Any) -> None:
    rows = json.loads(path.read_text(encoding="utf-8"))
    change(rows)
    path.write_text(json.dumps(rows, ensure_ascii=False, indent=4), encoding="utf-8")


def _bad_row(task: str, files: dict[str, dict[str, Path]]) -> tuple[Path, str]:
    """Break one row of ``task``'s training file; returns the file and what the line says."""
    path = files[task]["train"]
    if task == "ner":
        lines = path.read_text(encoding="utf-8").splitlines()
        lines[7] = "철수\tI-PS"  # two characters on one line
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path, f"{path}:8: expected one character, a tab and a tag"
    if task == "mrc":
        _edit_json(path, lambda r: r["data"][1]["paragraphs"][0]["qas"][0].update(question=""))
        return path, f"{path}:"  # the line of the question's guid
    field = {"ynat": "title", "sts": "sentence2", "nli": "hypothesis"}[task]
    _edit_json(path, lambda r: r[2].update({field: ""}))
    guid = json.loads(path.read_text(encoding="utf-8"))[2]["guid"]
    lines = path.read_text(encoding="utf-8").splitlines()
    line = next(i for i, text in enumerate(lines, start=1) if f'"{guid}"' in text)
    return path, f"{path}:{line}: {guid}: '{field}' missing or empty"


def _unseen_label(task: str, files: dict[str, dict[str, Path]]) -> tuple[Path, str]:
    """Give ``task``'s dev file a label (an entity type) its training file lacks."""
    path = files[task]["dev"]
    if task == "ner":
        text = path.read_text(encoding="utf-8").replace("일\tO\n했\tO", "일\tB-TI\n했\tI-TI")
        path.write_text(text, encoding="utf-8")
        return path, f"{path}:17: entity type 'TI' is not in the training file"  # 일
    train = files[task]["train"]
    key, value = ("label", "스포츠") if task == "ynat" else ("gold_label", "neutral")
    rows = json.loads(train.read_text(encoding="utf-8"))
    kept = [row for row in rows if row[key] != value]  # no training row of that class
    train.write_text(json.dumps(kept, ensure_ascii=False, indent=4), encoding="utf-8")
    return path, f"label {value!r} is not in the training file"


@pytest.mark.parametrize("fault", ["bad_row", "unseen_label"])
def test_suite_klue_refuses_bad_input_per_task_with_one_line(
    korean_bert: Path, tmp_path: Path, fault: str
) -> None:
    """A bad row in each task, and a dev label its training file lacks in each task that
    has labels (STS's scores and MRC's spans have none): one line naming the file (and
    line), exit 2, before any trial, nothing in MLflow."""
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    tasks = TASKS if fault == "bad_row" else ["ynat", "nli", "ner"]
    for task in tasks:
        data = write_klue(tmp_path / task / "klue_benchmark")
        path, fragment = (_bad_row if fault == "bad_row" else _unseen_label)(task, task_files(data))
        args = ["evaluate", f"model={korean_bert}", "suite=klue", f"data={data}"]
        args += [f"output={tmp_path / task / 'out'}", *PROTOCOL, f"tracking.uri={uri}"]
        done = run_cli(args, _env())
        assert done.returncode == 2, (task, done.stderr[-2000:])
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("bertpipe: error: ") and fragment in line, (task, line)
        assert str(path) in line, (task, line)
        assert not (tmp_path / task / "out" / "trials").exists()
    client = mlflow.MlflowClient(uri)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
