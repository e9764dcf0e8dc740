"""Benchmark datasets: deterministic prompts built without a tokenizer, looked up by name in a registry.

Prompts are made of words from ``WORDS``; each is a single token (with its leading space) in the SmolLM2,
GPT-2 and Llama vocabularies, so a prompt of N words is about N tokens on any of those models, and the same
seed gives byte-identical prompts whichever server is measured.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from splitserve.settings import setting

# Every word below is one token with its leading space in the SmolLM2-135M vocabulary (checked against the
# GGUF vocabulary) and in other byte-level BPE vocabularies. Order matters: it is part of the seed contract.
_WORD_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at which but have an
    had they you were their one all we can her has there been if more when will would who so no time people
    year way day man thing woman life child world school state family student group country problem hand
    part place case week company system program question work government number night point home water room
    mother area money story fact month lot right study book eye job word business issue side kind head house
    service friend father power hour game line end member law car city community name president team minute
    idea kid body information back parent face others level office door health person art war history party
    result change morning reason research girl guy moment air teacher force education good new first last
    long great little own other old big high different small large next early young important few public bad
    same able make know take see come think look want give use find tell ask seem feel try leave call keep
    let begin show hear play run move live believe bring happen write provide sit stand lose pay meet include
    continue set learn lead understand watch follow stop create speak read spend grow open walk win offer
    remember love consider appear buy wait serve die send expect build stay fall cut reach kill remain red
    blue green black white light dark river mountain tree flower bird fish stone road music color paper table
    window garden market letter film picture field rock sun moon star sea island forest summer winter spring
    north south east west
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send: a completion ``prompt`` (text, or token ids) or chat ``messages`` (exactly one is
    set).

    ``approx_prompt_tokens`` is the word count of the prompt (about its token count); it stands in for the
    prompt length when the server reports no usage. Requests that share a ``session_id`` are one user's
    conversation: the runner sends them in list order, each only after the previous one's answer finished.
    """

    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    approx_prompt_tokens: int = 0
    session_id: str | None = None
    """The conversation this request belongs to (e.g. ``user-3``); ``None`` for an independent request."""
    round_index: int = 0
    """Position in its session, 0 for the first round."""

    def as_messages(self) -> list[dict[str, str]]:
        """The request as chat messages: its own ``messages``, or the prompt as one user message."""
        if self.messages is not None:
            return self.messages
        return [{"role": "user", "content": self.prompt if isinstance(self.prompt, str) else ""}]

    def as_prompt(self) -> str | list[int]:
        """The request as one completion prompt: its own ``prompt`` (token ids stay ids), or the message contents
        joined."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m.get("content", "") for m in self.messages or [])


@dataclass(frozen=True)
class DatasetConfig:
    """Options for every dataset; each dataset reads the fields it needs."""

    random_input_len: int = setting(256, "random: mean prompt length in tokens (words).")
    random_output_len: int = setting(
        128, "random: mean max_tokens; shared-prefix: max_tokens; jsonl: max_tokens of lines without one."
    )
    random_range_ratio: float = setting(0.0, "random: lengths uniform in [L*(1-r), L*(1+r)].")
    shared_prefix_groups: int = setting(4, "shared-prefix: number of distinct prefixes.")
    shared_prefix_len: int = setting(
        1024, "shared-prefix: tokens (words) per common prefix; multiround: words in the shared system prompt."
    )
    shared_suffix_len: int = setting(64, "shared-prefix: tokens (words) per unique suffix.")
    dataset_path: Path | None = setting(None, "jsonl: file with {prompt|messages, max_tokens?} per line.")
    # multiround: the run has exactly num_users * num_rounds requests
    num_users: int = setting(8, "multiround: users (sessions), each one conversation.")
    num_rounds: int = setting(4, "multiround: questions per user; round r+1 is sent after round r's answer.")
    user_history_len: int = setting(
        0, "multiround: words of each user's own document that opens their chat (after the system prompt)."
    )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending values."""
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError(
                f"random lengths must be >= 1, got input={self.random_input_len} output={self.random_output_len}"
            )
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.shared_prefix_groups < 1 or self.shared_prefix_len < 0 or self.shared_suffix_len < 0:
            raise ValueError(
                f"shared-prefix needs groups >= 1 and lengths >= 0, got groups={self.shared_prefix_groups} "
                f"prefix={self.shared_prefix_len} suffix={self.shared_suffix_len}"
            )
        if self.user_history_len < 0:
            raise ValueError(f"user_history_len must be >= 0, got {self.user_history_len}")
        if self.num_users < 1 or self.num_rounds < 1:
            raise ValueError(
                f"multiround needs num_users >= 1 and num_rounds >= 1, got users={self.num_users} "
                f"rounds={self.num_rounds}"
            )


class Dataset(Protocol):
    """A source of benchmark requests."""

    def sample(self, num_prompts: int, seed: int) -> list[BenchRequest]:
        """Return exactly ``num_prompts`` requests; the same seed always gives the same list."""
        ...


DatasetFactory = Callable[[DatasetConfig], Dataset]
_DATASETS: dict[str, DatasetFactory] = {}


def register_dataset(name: str) -> Callable[[DatasetFactory], DatasetFactory]:
    """Class decorator: make a dataset available under ``name``."""

    def decorate(factory: DatasetFactory) -> DatasetFactory:
        _DATASETS[name] = factory
        return factory

    return decorate


def dataset_names() -> list[str]:
    return sorted(_DATASETS)


def get_dataset(name: str, config: DatasetConfig) -> Dataset:
    """Build the dataset registered as ``name``; ``ValueError`` lists the known names otherwise."""
    factory = _DATASETS.get(name)
    if factory is None:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(dataset_names())}")
    config.validate()
    return factory(config)


def default_num_prompts(name: str, config: DatasetConfig) -> int:
    """The request count when none is given: multiround's users x rounds, else 100."""
    if name == "multiround":
        return config.num_users * config.num_rounds
    return 100


def random_text(rng: random.Random, num_words: int) -> str:
    """``num_words`` words from ``WORDS``, each with a leading space (about one token per word)."""
    return "".join(" " + word for word in rng.choices(WORDS, k=num_words))


def _uniform_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1.0 - range_ratio)))
    high = max(low, int(mean * (1.0 + range_ratio)))
    return rng.randint(low, high)


@register_dataset("random")
class RandomDataset:
    """Independent random prompts; input and output lengths uniform around their means."""

    def __init__(self, config: DatasetConfig) -> None:
        self.config = config

    def sample(self, num_prompts: int, seed: int) -> list[BenchRequest]:
        rng = random.Random(seed)
        cfg = self.config
        requests = []
        for _ in range(num_prompts):
            num_words = _uniform_len(rng, cfg.random_input_len, cfg.random_range_ratio)
            max_tokens = _uniform_len(rng, cfg.random_output_len, cfg.random_range_ratio)
            prompt = random_text(rng, num_words)
            requests.append(BenchRequest(max_tokens, prompt=prompt, approx_prompt_tokens=num_words))
        return requests


@register_dataset("shared-prefix")
class SharedPrefixDataset:
    """G groups, each a common prefix of L words; every request adds its own S-word suffix.

    Request i belongs to group ``i % G``, so consecutive requests interleave the groups; a prefix cache (or
    a cache-aware router) should turn every group's prefix into a hit after its first request.
    """

    def __init__(self, config: DatasetConfig) -> None:
        self.config = config

    def sample(self, num_prompts: int, seed: int) -> list[BenchRequest]:
        rng = random.Random(seed)
        cfg = self.config
        prefixes = [random_text(rng, cfg.shared_prefix_len) for _ in range(cfg.shared_prefix_groups)]
        num_words = cfg.shared_prefix_len + cfg.shared_suffix_len
        requests = []
        for i in range(num_prompts):
            prompt = prefixes[i % len(prefixes)] + random_text(rng, cfg.shared_suffix_len)
            requests.append(BenchRequest(cfg.random_output_len, prompt=prompt, approx_prompt_tokens=num_words))
        return requests


@register_dataset("jsonl")
class JsonlDataset:
    """Requests read from a JSON-lines file: ``prompt`` or ``messages``, optional ``max_tokens``.

    Lines are used in file order (the seed is not used); when the file has fewer lines than requested, it
    is cycled.
    """

    def __init__(self, config: DatasetConfig) -> None:
        if config.dataset_path is None:
            raise ValueError("the jsonl dataset needs --dataset-path")
        self.path = config.dataset_path
        self.default_max_tokens = config.random_output_len

    def sample(self, num_prompts: int, seed: int) -> list[BenchRequest]:
        rows = self._load()
        return [rows[i % len(rows)] for i in range(num_prompts)]

    def _load(self) -> list[BenchRequest]:
        rows = []
        with self.path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    rows.append(self._parse(json.loads(line), line_no))
        if not rows:
            raise ValueError(f"{self.path} has no requests")
        return rows

    def _parse(self, row: Any, line_no: int) -> BenchRequest:
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{self.path}:{line_no}: need an object with exactly one of prompt, messages")
        max_tokens = int(row.get("max_tokens", self.default_max_tokens))
        if "prompt" in row:
            prompt = str(row["prompt"])
            return BenchRequest(max_tokens, prompt=prompt, approx_prompt_tokens=len(prompt.split()))
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
        num_words = sum(len(m["content"].split()) for m in messages)
        return BenchRequest(max_tokens, messages=messages, approx_prompt_tokens=num_words)


@register_dataset("multiround")
class MultiRoundDataset:
    """U users (``num_users``), each asking R questions (``num_rounds``) in one growing chat.

    Every conversation starts with the same system prompt of ``shared_prefix_len`` words (none when 0), then,
    with ``user_history_len``, a document of that many words of the user's own (a long chat history, a file
    the user works on: LMCache's multi-round QA benchmark shape), which the first question follows in the
    same user message. Round r (0-based) sends: system, then (question_0, answer_0, ..., question_r).
    Questions are about ``random_input_len`` words (varied by ``random_range_ratio``); the answers in the
    history are fixed ``random_output_len``-word texts drawn from the seed, not what the model said, so the
    whole workload is known up front and each round's prompt extends the previous round's prompt exactly.
    Every request asks for ``random_output_len`` tokens.

    ``sample`` needs ``num_prompts == num_users * num_rounds``. The requests come round by round (every
    user's round 0, then every user's round 1, ...), so arrival times drawn in list order space a user's
    rounds about ``num_users`` arrivals apart. Within a round the users come in a shuffled (seeded) order, as
    independent users would: in a fixed order, a round-robin router would send each user to the same worker
    every round whenever the number of users is a multiple of the number of workers. Session ids are
    ``user-<u>``.
    """

    def __init__(self, config: DatasetConfig) -> None:
        self.config = config

    def sample(self, num_prompts: int, seed: int) -> list[BenchRequest]:
        cfg = self.config
        if num_prompts != cfg.num_users * cfg.num_rounds:
            raise ValueError(
                f"multiround sends num_users * num_rounds = {cfg.num_users} * {cfg.num_rounds} = "
                f"{cfg.num_users * cfg.num_rounds} requests, but num_prompts is {num_prompts}; "
                "leave --num-prompts out or make it match"
            )
        rng = random.Random(seed)
        system_prompt = random_text(rng, cfg.shared_prefix_len)
        history = [{"role": "system", "content": system_prompt}] if system_prompt else []
        sessions = [self._session(rng, f"user-{u}", history) for u in range(cfg.num_users)]
        order_rng = random.Random(seed + 1)  # its own stream: the texts do not depend on the order
        requests = []
        for r in range(cfg.num_rounds):
            order = list(range(cfg.num_users))
            order_rng.shuffle(order)
            requests += [sessions[u][r] for u in order]
        return requests

    def _session(self, rng: random.Random, session_id: str, history: list[dict[str, str]]) -> list[BenchRequest]:
        """One user's rounds; request r's messages are request r-1's plus its answer and a new question."""
        cfg = self.config
        messages = list(history)
        requests = []
        document = random_text(rng, cfg.user_history_len) + "\n\n" if cfg.user_history_len else ""
        for r in range(cfg.num_rounds):
            question = random_text(rng, _uniform_len(rng, cfg.random_input_len, cfg.random_range_ratio))
            if r == 0:
                question = document + question
            messages = [*messages, {"role": "user", "content": question}]
            num_words = sum(len(m["content"].split()) for m in messages)
            requests.append(
                BenchRequest(
                    cfg.random_output_len,
                    messages=messages,
                    approx_prompt_tokens=num_words,
                    session_id=session_id,
                    round_index=r,
                )
            )
            messages = [*messages, {"role": "assistant", "content": random_text(rng, cfg.random_output_len)}]
        return requests
