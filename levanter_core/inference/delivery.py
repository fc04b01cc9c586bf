r"""Turning a slot's new tokens into its request's results: where the request ends (an
end-of-sequence token, a stop string, its token budget, the context's end), its text, and the
:class:`~levanter_core.inference.requests.Update`\ s streamed to its listener. A part of
:class:`~levanter_core.inference.engine.Engine`, which inherits it."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from levanter_core.inference.requests import Completion, Request, Update, _Slot

if TYPE_CHECKING:
    from levanter_core.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class _Delivery:
    """The :class:`~levanter_core.inference.engine.Engine`'s methods that hand requests their
    results; they read the engine's ``_slots``, ``eos_ids``, ``max_seq_len`` and ``tokenizer``."""

    _slots: list[_Slot | None]
    eos_ids: tuple[int, ...]
    max_seq_len: int
    tokenizer: Tokenizer | None

    # -- turning tokens into results -----------------------------------------------------------
    def _accept(self, slot: int, tokens: list[int], logprobs: list[float], top_ids, top_lps) -> None:
        """Give slot ``slot``'s request its new ``tokens`` (``top_ids``/``top_lps``: the
        alternatives at each, ``[len(tokens), top_n]``); free the slot if it has ended."""
        held = self._slots[slot]
        assert held is not None  # called for a slot that holds a request (just prefilled, or decoding)
        request = held.request
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        params = request.params
        reason = None
        added = 0
        for j, (token, logprob) in enumerate(zip(tokens, logprobs)):
            if token in self.eos_ids and not params.ignore_eos:
                reason = "stop"
                break
            request.tokens.append(token)
            request.logprobs.append(logprob)
            if params.top_logprobs:
                n = params.top_logprobs
                request.top_logprobs.append(list(zip(top_ids[j, :n].tolist(), top_lps[j, :n].tolist())))
            added += 1
            if (
                len(request.tokens) >= params.max_new_tokens
                or len(request.prompt) + len(request.tokens) >= self.max_seq_len
            ):
                reason = "length"
                break
        text, cut = self._text(request)
        if cut is not None:  # a stop string: the text ends before it, and so do the tokens
            reason = "stop"
        if request.cancelled:
            reason = reason or "cancelled"
        completion = None
        if reason is not None:
            self._slots[slot] = None
            kept = slice(None, cut)
            completion = Completion(
                request.prompt,
                request.tokens[kept],
                request.logprobs[kept],
                text,
                reason,
                request.index,
                request.first_token_at - request.submitted,
                request.top_logprobs[kept] if params.top_logprobs else None,
            )
        self._deliver(request, text, added, completion)

    def _text(self, request: Request) -> tuple[str | None, int | None]:
        """The request's text so far, cut at the first stop string; and, when a stop string
        appeared, how many tokens the text keeps."""
        if self.tokenizer is None:
            return None, None
        text = self.tokenizer.decode(request.tokens)
        found = [text.find(s) for s in request.params.stop if s in text]
        if not found:
            return text, None
        end = min(found)
        # the fewest tokens whose text covers what is kept
        kept = next(n for n in range(len(request.tokens) + 1) if len(self.tokenizer.decode(request.tokens[:n])) >= end)
        return text[:end], kept

    def _deliver(self, request: Request, text: str | None, added: int, completion: Completion | None) -> None:
        if request.on_update is not None:
            if text is None:
                delta = ""
            elif completion is not None:
                delta = text[request.emitted :]
            else:
                # hold back what could still become a stop string, and half a character
                hold = max((len(s) - 1 for s in request.params.stop), default=0)
                safe = len(text) - hold
                while safe > request.emitted and text[safe - 1] == "\ufffd":
                    safe -= 1
                delta = text[request.emitted : max(safe, request.emitted)]
            request.emitted += len(delta)
            new = slice(len(request.tokens) - added, None) if added else slice(0, 0)
            top = request.top_logprobs[len(request.top_logprobs) - added :] if added and request.top_logprobs else []
            self._notify(request, Update(delta, request.tokens[new], request.logprobs[new], completion, top))
        if completion is not None:
            request._completion = completion
            request._done.set()

    @staticmethod
    def _notify(request: Request, update: Update) -> None:
        if request.on_update is None:
            return
        try:
            request.on_update(update)
        except Exception:  # a listener's failure (a closed connection) is the listener's
            logger.exception("a request's update listener failed; cancelling the request")
            request.cancel()

    def _finish_cancelled(self, request: Request) -> None:
        """End a request cancelled before it left the queue (its listener hears of it too)."""
        completion = Completion(request.prompt, [], [], "" if self.tokenizer else None, "cancelled", request.index)
        self._deliver(request, completion.text, 0, completion)
