"""Seeded Generate calls for fuzzing a replica: valid requests, field mutations of every GenerateRequest field,
raw-bytes mutations of valid serialized requests, and mutated retry headers.

Call `index` of seed `seed` is a pure function of the two (its own random.Random), so a failing call is made
again alone with `GenerateFuzzer(seed, ...).call(index)`. Nothing here talks to a server: tests/inference/
test_fuzz.py sends 2,000 of them, bench/fuzz.py 100,000. Send `call.raw` as the request bytes, e.g. with
`channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from zeroqueue.inference.v1 import inference_pb2 as pb

from tests import fuzz_formats
from tests.fuzz_bytes import BYTE_MUTATIONS

# the wire helpers and the judging of answers live beside this module; they are named here too, as callers import
# them from here
from tests.fuzz_outcomes import SOFT_METADATA_BYTES, Outcome, Tally, send, status_bytes  # noqa: F401
from tests.fuzz_wire import GENERATE, FuzzCall, delimited, tag, varint  # noqa: F401

FIELDS = tuple(f.name for f in pb.GenerateRequest.DESCRIPTOR.fields)
_WORDS = (
    "def",
    "add",
    "(a, b)",
    ":\n",
    "    return",
    " a + b",
    "class",
    "Point",
    "for i in range(10)",
    "print",
    "The quick brown fox",
    "Überraschung!",
    "東京",
    "🙂",
    "\t",
    " ",
    "\n",
)
_FLOATS = (
    float("nan"),
    float("inf"),
    float("-inf"),
    -0.0,
    0.0,
    1e-45,
    1.2e-38,
    1e-30,
    1e-6,
    1e-4,
    0.5,
    1.0,
    1.0000001,
    2.0,
    100.0,
    3.4e38,
    -1e-45,
    -1.0,
)
_INT32 = (0, 1, -1, 2, 7, 255, 256, 511, 512, 4096, 2**31 - 1, -(2**31), 2**30)
_HEADER_VALUES = (
    "0",
    "1",
    "3",
    "999999",
    "1000000",
    "-1",
    "+1",
    "1.5",
    " 2",
    "0x10",
    "abc",
    "",
    "9" * 4301,
    "9" * 5000,
    "1" * 7,
    "00000000000000000001",
)


class GenerateFuzzer:
    """`model`, `context_length` and `vocab_size` are the replica's (ListModels), so that boundaries are hit;
    `max_request_bytes` bounds how large a generated request gets (a few cross the server's own bound)."""

    def __init__(
        self,
        seed: int,
        model: str = "",
        context_length: int = 256,
        vocab_size: int = 320,
        max_request_bytes: int = 256 << 10,
    ) -> None:
        self.seed, self.model = seed, model
        self.context_length, self.vocab_size = context_length, vocab_size
        self.max_request_bytes = max_request_bytes

    def calls(self, num_calls: int, start: int = 0) -> Iterator[FuzzCall]:
        for index in range(start, start + num_calls):
            yield self.call(index)

    def call(self, index: int) -> FuzzCall:
        rng = random.Random(f"{self.seed}:{index}")
        roll = rng.random()
        if roll < 0.15:
            return FuzzCall(index, "valid", self.valid(rng).SerializeToString())
        if roll < 0.55:
            names = rng.sample(FIELDS, rng.choice((1, 1, 1, 2, 3)))
            message = self.valid(rng)
            for name in names:
                getattr(self, f"_mutate_{name}")(rng, message)
            return FuzzCall(index, "field:" + ",".join(sorted(names)), message.SerializeToString())
        if roll < 0.90:
            mutation = rng.choice(BYTE_MUTATIONS)
            raw = mutation(self, rng, self.valid(rng).SerializeToString())
            return FuzzCall(index, "bytes:" + mutation.__name__.strip("_"), raw[: self.max_request_bytes + 4096])
        header = rng.choice(("x-retry-attempt", "grpc-previous-rpc-attempts"))
        values = tuple((header, rng.choice(_HEADER_VALUES)) for _ in range(rng.choice((1, 1, 2))))
        return FuzzCall(index, f"header:{header}", self.valid(rng).SerializeToString(), values)

    # --- a valid request: short, cheap to serve (a few tokens) ---------------------------------------------------

    def _text(self, rng: random.Random, max_words: int = 12) -> str:
        return "".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max_words)))

    def valid(self, rng: random.Random) -> pb.GenerateRequest:
        message = pb.GenerateRequest(max_tokens=rng.randint(1, 4))
        if rng.random() < 0.7:
            message.prompt = self._text(rng)
        else:
            message.prompt_token_ids.extend(rng.randrange(self.vocab_size) for _ in range(rng.randint(1, 16)))
        if self.model and rng.random() < 0.5:
            message.model = self.model
        if rng.random() < 0.5:
            message.temperature = rng.choice((0.0, 0.7, 1.0))
        if rng.random() < 0.3:
            message.top_p = rng.choice((0.5, 0.9, 1.0))
        if rng.random() < 0.3:
            message.top_k = rng.choice((0, 1, 40))
        if rng.random() < 0.5:
            message.seed = rng.randrange(2**64)
        if rng.random() < 0.2:
            message.stop.extend(rng.choice(("\n", "return", ")", "🙂")) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.2:
            message.labels.update({"team": "fuzz", "cost_center": f"cc-{rng.randrange(100)}"})
        # a fresh id: a reused one may meet its own earlier call in flight (ALREADY_EXISTS, not a bug)
        if rng.random() < 0.5:
            message.request_id = f"fuzz-{self.seed}-{rng.getrandbits(64):016x}"
        fuzz_formats.add_valid(rng, message)
        return message

    # --- one mutation per GenerateRequest field -------------------------------------------------------------------

    def _long(self, rng: random.Random, alphabet: str = "ab") -> str:
        return rng.choice(alphabet) * rng.choice((65, 129, 1000, 10_000, self.max_request_bytes // 2))

    def _mutate_model(self, rng, m) -> None:
        m.model = rng.choice(
            (
                "gpt-9",
                self.model + "x",
                self.model.upper() or "X",
                " ",
                "\x00",
                "é" * 100,
                self._long(rng),
                "\u202e" + self.model,
            )
        )

    def _mutate_prompt(self, rng, m) -> None:
        del m.prompt_token_ids[:]
        m.prompt = rng.choice(
            (
                "",
                " ",
                "\x00",
                "\ufeff",
                "\U0010ffff",
                "x " * self.context_length,
                "🙂" * (self.context_length * 2),
                self._long(rng, "x y"),
                self._text(rng, 200),
                "x" * (self.context_length * 32 + 1),
                "\r\n" * 100,
            )
        )

    def _mutate_prompt_token_ids(self, rng, m) -> None:
        m.ClearField("prompt")
        choice = rng.randrange(6)
        if choice == 0:
            ids = [rng.choice((-1, self.vocab_size, 2**31 - 1, -(2**31)))]
        elif choice == 1:
            ids = [rng.randrange(self.vocab_size) for _ in range(self.context_length + rng.choice((-1, 0, 1, 50)))]
        elif choice == 2:
            ids = [1] * min(rng.choice((10_000, 100_000, 1_000_000)), self.max_request_bytes)
        elif choice == 3:
            ids = [rng.randrange(self.vocab_size) for _ in range(8)] + [-5]
        elif choice == 4:
            ids = []
        else:
            ids = [rng.randrange(self.vocab_size) for _ in range(rng.randint(1, 8))]
            m.prompt = "both"
        m.prompt_token_ids[:] = ids

    def _mutate_max_tokens(self, rng, m) -> None:
        m.max_tokens = rng.choice(_INT32 + (self.context_length - 1, self.context_length, self.context_length + 1))

    def _mutate_temperature(self, rng, m) -> None:
        m.temperature = rng.choice(_FLOATS)

    def _mutate_top_p(self, rng, m) -> None:
        m.top_p = rng.choice(_FLOATS)

    def _mutate_top_k(self, rng, m) -> None:
        m.top_k = rng.choice(_INT32 + (self.vocab_size - 1, self.vocab_size, self.vocab_size + 1))

    def _mutate_seed(self, rng, m) -> None:
        m.seed = rng.choice((0, 1, 2**63 - 1, 2**63, 2**64 - 1))

    def _mutate_stop(self, rng, m) -> None:
        del m.stop[:]
        choice = rng.randrange(5)
        if choice == 0:
            m.stop.extend([""] * rng.randint(1, 8))
        elif choice == 1:
            m.stop.extend(["y" * 65] * rng.choice((8, 9, 100, 1000)))
        elif choice == 2:
            m.stop.extend(rng.choice(("\x00", "🙂", "\ufffd", " ", "é" * 64, "é" * 65)) for _ in range(8))
        elif choice == 3:
            m.stop.extend(["stop"] * rng.choice((9, 10_000)))
        else:
            m.stop.append(self._long(rng))

    def _mutate_request_id(self, rng, m) -> None:
        m.request_id = rng.choice(
            (
                "has spaces!",
                "é",
                "\x00",
                "a" * 128,
                "a" * 129,
                self._long(rng),
                "../../etc",
                "id\nnewline",
                f"fuzz-{self.seed}-{rng.getrandbits(64):x}",
            )
        )

    def _mutate_service_class(self, rng, m) -> None:
        m.service_class = rng.choice(
            (
                "standard",  # every replica offers it
                "gold",
                "Standard",
                "standard ",
                "\x00",
                "é",
                "s" * 32,
                "s" * 33,
                self._long(rng),
            )
        )

    def _mutate_messages(self, rng, m) -> None:
        fuzz_formats.mutate_messages(rng, m, self._long(rng, "x y"))

    def _mutate_response_format(self, rng, m) -> None:
        fuzz_formats.mutate_response_format(rng, m)

    def _mutate_logprobs(self, rng, m) -> None:
        fuzz_formats.mutate_logprobs(rng, m)

    def _mutate_top_logprobs(self, rng, m) -> None:
        fuzz_formats.mutate_top_logprobs(rng, m)

    def _mutate_labels(self, rng, m) -> None:
        m.labels.clear()
        choice = rng.randrange(6)
        if choice == 0:
            m.labels.update({f"k{i}": "v" for i in range(rng.choice((17, 100, 1000)))})
        elif choice == 1:
            m.labels.update({f"Bad Key {i}" + "K" * rng.choice((1, 100, 5000)): "x" for i in range(16)})
        elif choice == 2:
            m.labels.update({"team": "t" * rng.choice((128, 129, 5000))})
        elif choice == 3:
            m.labels.update({"team": "", "cost_center": "\x00\x1f", "x": "é" * 129})
        elif choice == 4:
            m.labels.update({self._long(rng, "ab"): "v"})
        else:
            m.labels.update({"": "empty key", "team": "🙂"})
