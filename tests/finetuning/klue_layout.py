"""KLUE-format files written by the tests: a ``klue_benchmark`` folder as KLUE's release
lays it out (``ynat-v1.1/ynat-v1.1_train.json``, ``klue-ner-v1.1/klue-ner-v1.1_dev.tsv``,
...), a few Korean rows per task, written here (no KLUE text), and a tiny cased BERT whose
vocabulary holds their syllables, whole and as word pieces.

The fields are those KLUE's baseline reads (``KLUE-benchmark/KLUE-baseline``,
``klue_baseline/data/{ynat,klue_sts,klue_nli,klue_ner,klue_mrc}.py``); the NER file has the
release's five header comment lines and a ``## <guid><TAB><marked sentence>`` line per
sentence.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

YNAT = {
    "정치": ["국회 본회의 예산안 통과", "대통령 정상회담 개최", "여당 야당 대표 회동"],
    "경제": ["코스피 금리 동결 상승 마감", "수출 증가 무역 흑자", "물가 상승 소비 위축"],
    "사회": ["경찰 교통사고 조사 착수", "서울 폭우 피해 속출", "학교 급식 위생 점검"],
    "생활문화": ["전시회 개막 관람객 몰려", "새 영화 개봉 관객 호평", "여름 축제 공연 개최"],
    "세계": ["미국 대선 후보 토론", "일본 지진 해외 피해", "유럽 정상 회의 합의"],
    "IT과학": ["스마트폰 신제품 공개", "인공지능 반도체 개발", "우주 로켓 발사 성공"],
    "스포츠": ["축구 대표팀 승리", "야구 결승 홈런", "농구 리그 우승"],
}
STS = [  # (sentence1, sentence2, real-label)
    ("방이 넓고 깨끗합니다.", "방이 깨끗하고 넓어요.", 4.6),
    ("위치가 좋아서 편리합니다.", "위치가 편리해서 좋습니다.", 4.2),
    ("호스트가 친절했습니다.", "호스트분이 매우 친절하셨어요.", 3.8),
    ("주차장이 있습니다.", "근처에 지하철역이 있습니다.", 1.2),
    ("아침 식사가 맛있었습니다.", "방에서 바다가 보입니다.", 0.4),
    ("소음이 조금 들려요.", "거리의 소음이 들립니다.", 3.4),
    ("다시 방문하고 싶습니다.", "수영장은 유료입니다.", 0.0),
    ("침대가 편안했습니다.", "침대가 불편했습니다.", 1.8),
]
NLI = [  # (premise, hypothesis, gold_label)
    ("철수는 서울에서 일한다.", "철수는 직장이 있다.", "entailment"),
    ("철수는 서울에서 일한다.", "철수는 부산에서 일한다.", "contradiction"),
    ("철수는 서울에서 일한다.", "철수는 회사원이다.", "neutral"),
    ("영희는 어제 영화를 봤다.", "영희는 영화를 보았다.", "entailment"),
    ("영희는 어제 영화를 봤다.", "영희는 영화를 본 적이 없다.", "contradiction"),
    ("영희는 어제 영화를 봤다.", "영희는 친구와 영화를 봤다.", "neutral"),
]
NER = [  # <text:TYPE> marks an entity, as the release's guid lines do
    "<김철수:PS>는 <서울:LC>에서 일했다.",
    "<이영희:PS> 씨는 <어제:DT> <부산:LC>에 갔다.",
    "<서울 시청:LC> 앞에서 <박민수:PS>를 만났다.",
    "<지난 5일:DT> <대구:LC>에서 축제가 열렸다.",
    "<최지우:PS>는 <오늘:DT> 출근했다.",
    "<부산:LC>과 <서울:LC>은 멀다.",
]
MRC = [  # (context, [(question, answer or None for an unanswerable one)])
    (
        "김철수는 서울에서 태어났다. 그는 부산에서 일했다.",
        [("김철수는 어디에서 태어났나?", "서울"), ("김철수는 어디에서 일했나?", "부산")],
    ),
    (
        "이영희는 대구에서 자랐다. 그녀는 의사가 되었다.",
        [("이영희는 어디에서 자랐나?", "대구"), ("이영희의 동생은 누구인가?", None)],
    ),
    (
        "박민수는 광주에서 학교를 다녔다. 그는 교사가 되었다.",
        [("박민수는 어디에서 학교를 다녔나?", "광주"), ("박민수의 직업은 무엇인가?", "교사")],
    ),
]
NER_HEADER = [
    "## 토큰, 레이블 구분자 : \\t",
    "## 토큰 구분자 : \\n",
    "## 문장 구분자 : \\n\\n",
    "## 주석 : ##",
    "## 컬럼명 : CHAR\tNE_TAG",
]
_MARK = re.compile(r"<([^:<>]+):([A-Z]+)>")


def ner_chars(marked: str) -> list[tuple[str, str]]:
    """(character, tag) of a marked sentence: B- on an entity's first character, I- on the
    rest (spaces inside an entity included, as the release tags them), O elsewhere."""
    out: list[tuple[str, str]] = []
    position = 0
    for match in _MARK.finditer(marked):
        out += [(ch, "O") for ch in marked[position : match.start()]]
        text, kind = match.group(1), match.group(2)
        out += [(ch, ("B-" if i == 0 else "I-") + kind) for i, ch in enumerate(text)]
        position = match.end()
    out += [(ch, "O") for ch in marked[position:]]
    return out


def ner_file(marked: list[str], split: str) -> str:
    lines = list(NER_HEADER)
    for i, sentence in enumerate(marked):
        if i:
            lines.append("")
        lines.append(f"## klue-ner-v1.1_{split}_{i:05d}\t{sentence}")
        lines += [f"{ch}\t{tag}" for ch, tag in ner_chars(sentence)]
    return "\n".join(lines) + "\n"


def _mrc(split: str, items: list[tuple[str, list[tuple[str, str | None]]]]) -> dict[str, Any]:
    data = []
    for p, (context, questions) in enumerate(items):
        qas = []
        for q, (question, answer) in enumerate(questions):
            qa: dict[str, Any] = {
                "question": question,
                "guid": f"klue-mrc-v1.1_{split}_{p:05d}_{q}",
                "question_type": 3 if answer is None else 1,
                "is_impossible": answer is None,
                "answers": []
                if answer is None
                else [{"answer_start": context.index(answer), "text": answer}],
            }
            qas.append(qa)
        data.append({"title": f"문서 {p}", "paragraphs": [{"context": context, "qas": qas}]})
    return {"version": "1.1", "data": data}


def task_files(root: Path) -> dict[str, dict[str, Path]]:
    """Each task's training and dev file under ``root`` (the ``klue_benchmark`` folder)."""
    names = {"ynat": "ynat", "sts": "klue-sts", "nli": "klue-nli", "ner": "klue-ner"}
    names["mrc"] = "klue-mrc"
    out = {}
    for task, stem in names.items():
        ext = "tsv" if task == "ner" else "json"
        folder = root / f"{stem}-v1.1"
        out[task] = {s: folder / f"{stem}-v1.1_{s}.{ext}" for s in ("train", "dev")}
    return out


def write_klue(root: Path, copies: int = 1) -> Path:
    """Write the five tasks' training and dev files under ``root``; returns ``root``.
    ``copies``: each training row that many times (each with its own guid), for protocols
    whose batch is larger than the 6 training rows of the smallest task."""
    files = task_files(root)
    for paths in files.values():
        paths["train"].parent.mkdir(parents=True, exist_ok=True)

    def dump(path: Path, obj: Any) -> None:
        path.write_text(json.dumps(obj, ensure_ascii=False, indent=4) + "\n", encoding="utf-8")

    rows: dict[str, list[dict[str, Any]]] = {"train": [], "dev": []}
    for label, titles in YNAT.items():
        for i, title in enumerate(titles):
            split = "dev" if i == 2 else "train"
            for _ in range(copies if split == "train" else 1):
                guid = f"ynat-v1.1_{split}_{len(rows[split]):05d}"
                rows[split].append({"guid": guid, "title": title, "label": label})
    for split in rows:
        dump(files["ynat"][split], rows[split])
    for split, part in (("train", STS[:6] * copies), ("dev", STS[4:])):
        dump(
            files["sts"][split],
            [
                {
                    "guid": f"klue-sts-v1.1_{split}_{i:05d}",
                    "sentence1": a,
                    "sentence2": b,
                    "labels": {"label": round(y, 1), "real-label": y, "binary-label": int(y >= 3)},
                }
                for i, (a, b, y) in enumerate(part)
            ],
        )
    for split, part in (("train", NLI * copies), ("dev", NLI[:3])):
        dump(
            files["nli"][split],
            [
                {
                    "guid": f"klue-nli-v1.1_{split}_{i:05d}",
                    "premise": p,
                    "hypothesis": h,
                    "gold_label": y,
                }
                for i, (p, h, y) in enumerate(part)
            ],
        )
    files["ner"]["train"].write_text(ner_file(NER * copies, "train"), encoding="utf-8")
    files["ner"]["dev"].write_text(ner_file(NER[:3], "dev"), encoding="utf-8")
    dump(files["mrc"]["train"], _mrc("train", MRC * copies))
    dump(files["mrc"]["dev"], _mrc("dev", MRC[:2]))
    return root


def korean_vocab() -> list[str]:
    """BERT's specials, punctuation, every syllable of the rows above whole and as a word
    piece (``##가``), and a few whole words, so that words split into pieces of one or more
    syllables (``서울에서`` -> ``서울``, ``##에``, ``##서``)."""
    text = " ".join(
        [
            *(t for titles in YNAT.values() for t in titles),
            *YNAT,
            *(f"{a} {b}" for a, b, _ in STS),
            *(f"{p} {h}" for p, h, _ in NLI),
            *("".join(ch for ch, _ in ner_chars(s)) for s in NER),
            *(c + " " + " ".join(q for q, _ in qs) for c, qs in MRC),
        ]
    )
    syllables = sorted({ch for ch in text if "\uac00" <= ch <= "\ud7a3"})
    words = ["서울", "부산", "김철수", "이영희", "축구", "영화", "스마트폰"]
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    punctuation = list(".,!?'\"()-:;%")
    latin = ["IT", "5", *"abcdefghijklmnopqrstuvwxyz"]
    return list(
        dict.fromkeys(
            [*specials, *punctuation, *latin, *words, *syllables, *(f"##{s}" for s in syllables)]
        )
    )
