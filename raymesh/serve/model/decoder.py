"""`BatchDecoder`: continuous batching of a causal LM's token streams in a replica.

One thread owns the model and steps every active sequence a token at a time, as one batch
(`raymesh.train.hf.KVBatch`: one KV cache, each row left-padded and masked, each
sequence at its own positions). Between two steps, new sequences join (up to `max_streams` at
once; more wait their turn, first come first served): each is prefilled alone, sends its
first token at once, and is spliced into the cache as a row; finished, cancelled or failed
ones leave (their rows dropped), so a stream never waits for another to end. A model whose
cache cannot be spliced (not transformers' DynamicCache of plain layers) recomputes every
position at every step instead (`next_logits`), correct and slower. Each sequence keeps its
own:
- stream: its pieces go to its own `emit`, a piece per token, as `raymesh.train.hf:generate`
  cuts them ("text", piece), then ("end", None); ("error", (type, message)) when its prompt
  cannot be taken (PromptTooLong) or the model raised on its batch; ("stopped", None) once it
  left on `cancel`, before the next token;
- `max_tokens`, `temperature` and seed: sampling draws from a torch.Generator of its own, seeded
  with its seed, one draw per token, so what it is batched with changes none of its draws;
- eos, which ends it alone.
What holds: a greedy sequence's text is the text it gets alone, up to the float rounding of
batched arithmetic (a padded row's logits may differ in the last bits from the unpadded ones:
only a near-tie between two tokens could turn on that). A sampled one's draws are the ones it
gets alone, taken from the same rounded probabilities: its text too is its text alone, but for
a draw that lands within that rounding of the boundary between two tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BatchDecoder", "Sequence"]

Emit = Callable[[str, Any], None]


class Sequence:
    """One request in the batch; `stop` (a threading.Event) cancels it before its next token."""

    def __init__(
        self, prompt: str, max_tokens: int, temperature: float, seed: int, emit: Emit
    ) -> None:
        self.prompt, self.max_tokens, self.temperature = prompt, max_tokens, temperature
        self.seed, self.emit = seed, emit
        self.stop = threading.Event()
        self.ids: list[int] = []
        self.pieces: Any = None  # its TextPieces, once it has joined
        self.generator: torch.Generator | None = None


class BatchDecoder:
    """Decodes the sequences `submit`ted to it, at most `max_streams` at once, on a thread of
    its own (daemon; it ends on `close`). `module` is a Hugging Face causal LM whose folder's
    tokenizer is known; `check(prompt, max_tokens)` raises on a prompt that cannot be taken
    (`LoadedModel.check_context`)."""

    def __init__(
        self, module: torch.nn.Module, max_streams: int, check: Callable[[str, int], None]
    ) -> None:
        from raymesh.train import hf  # a causal LM's: transformers is there

        self._hf = hf
        self.module = module
        self.max_streams = max_streams
        self._check = check
        self._wake = threading.Condition()
        self._joining: list[Sequence] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # batched forward passes run
        self.most_at_once = 0  # the largest batch stepped

    def submit(
        self, prompt: str, max_tokens: int, temperature: float, seed: int, emit: Emit
    ) -> Sequence:
        """Queue a sequence; it joins the batch before the next step that has room."""
        sequence = Sequence(prompt, max_tokens, temperature, seed, emit)
        with self._wake:
            if self._closed:
                raise RuntimeError("this decoder is closed (its model was reloaded)")
            self._joining.append(sequence)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="raymesh-decode", daemon=True
                )
                self._thread.start()
            self._wake.notify()
        return sequence

    def close(self) -> None:
        """End the thread once no sequence is left (a reload: the replica takes no stream
        meanwhile)."""
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _run(self) -> None:
        active: list[Sequence] = []  # in the order of the KV batch's rows
        kv = self._hf.KVBatch(self.module)
        splices = True  # the model's cache can be spliced: else every step recomputes
        with torch.inference_mode():  # per thread: this one owns the model's forward passes
            while True:
                with self._wake:
                    while not (self._joining or active or self._closed):
                        self._wake.wait()
                    if self._closed and not (self._joining or active):
                        return
                    room = self.max_streams - len(active)
                    joined, self._joining = self._joining[:room], self._joining[room:]
                staying = [i for i, s in enumerate(active) if not _left(s)]
                if len(staying) < len(active):
                    active = [active[i] for i in staying]
                    if splices:
                        kv.keep(staying)
                try:
                    for s in joined:  # prefilled alone; its first token goes out at once
                        if not self._join(s):
                            continue
                        logits, cache = kv.prefill(s.ids)
                        if self._step(s, self._tokens([s], logits[None])[0]):
                            splices = splices and kv.join(cache, len(s.ids) - 1)
                            active.append(s)
                    if not active:
                        continue
                    if splices:
                        logits = kv.step([s.ids[-1] for s in active])
                    else:
                        logits = self._hf.next_logits(self.module, [s.ids for s in active])
                except Exception as e:  # the model failed on this batch: each stream hears
                    for s in dict.fromkeys([*active, *joined]):  # each once
                        s.emit("error", (type(e).__name__, str(e)[:500]))
                    active, kv = [], self._hf.KVBatch(self.module)
                    continue
                self.steps += 1
                self.most_at_once = max(self.most_at_once, len(active))
                going = [
                    self._step(s, t)
                    for s, t in zip(active, self._tokens(active, logits), strict=True)
                ]
                if not all(going):
                    staying = [i for i, g in enumerate(going) if g]
                    active = [active[i] for i in staying]
                    if splices:
                        kv.keep(staying)

    def _join(self, s: Sequence) -> bool:
        """Tokenize `s`'s prompt; False (its stream told why) when it cannot be taken."""
        try:
            self._check(s.prompt, s.max_tokens)
            tokenizer = self._hf.tokenizer_of(self.module)
            s.ids = self._hf.prompt_ids(tokenizer, s.prompt)
        except Exception as e:
            s.emit("error", (type(e).__name__, str(e)[:500]))
            return False
        s.pieces = self._hf.TextPieces(tokenizer)
        s.generator = torch.Generator().manual_seed(s.seed)
        return True

    def _tokens(self, batch: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Each sequence's next token from its row of `logits` [rows, V]: the greedy ones' in
        one argmax over the batch (a row at a time costs more than a small model's step), the
        sampled ones' each drawn with its own generator."""
        tokens = logits.argmax(-1).tolist()
        for i, s in enumerate(batch):
            if s.temperature != 0:
                assert s.generator is not None  # (set as it joined)
                tokens[i] = self._hf.choose(logits[i], s.temperature, s.generator)
        return tokens

    def _step(self, s: Sequence, token: int) -> bool:
        """Send the piece of `s`'s next `token`; False when it ended (else the token is its
        newest id, which the next step runs)."""
        if token == s.pieces.tokenizer.eos_token_id:  # ends this sequence alone
            if rest := s.pieces.rest():  # what was held back, as it is
                s.emit("text", rest)
            s.emit("end", None)
            return False
        last = len(s.pieces.made) + 1 >= s.max_tokens
        s.emit("text", s.pieces.add(token, last))
        if last:
            s.emit("end", None)
            return False
        s.ids.append(token)
        return True


def _left(s: Sequence) -> bool:
    """Whether `s` was cancelled: then it is told so, and leaves before the next step."""
    if s.stop.is_set():
        s.emit("stopped", None)
        return True
    return False
