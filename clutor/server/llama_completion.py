"""llama-server's native ``POST /completion`` (and ``/completions``): its request fields and its reply's.

Request: ``prompt`` (a string, token ids, or strings and ids mixed, as /tokenize reads them), ``n_predict``
(-1, the default: until the end of the context or an end-of-generation token; ``max_tokens`` too),
``stream``, ``cache_prompt`` (accepted: the prefix cache is always on), ``grammar`` / ``json_schema``,
``id_slot``, ``n_probs``, ``return_tokens`` and the sampling fields every route takes.

Reply (llama-server's, checked against its recorded answers in tests/golden/llama_server/): the whole
``{"content", "tokens", "id_slot", "stop": true, "model", "tokens_predicted", "tokens_evaluated",
"generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word", "tokens_cached",
"timings"}``; streamed, one ``{"content", "tokens", "stop": false, ...}`` event per piece of text, then that
final object with empty content. No ``[DONE]`` line, as llama-server's native stream.
"""
from __future__ import annotations

from .errors import bad_request
from .requests import Defaults, GenRequest, gen_request, int_field
from .responses import timings

__all__ = ["parse_llama_completion", "LlamaShaper"]

_STOP_TYPES = {"eos": "eos", "length": "limit", "stop": "word"}


def parse_llama_completion(body: dict, tokenizer, n_ctx: int, d: Defaults) -> GenRequest:
    from .chat_plan import plan_completion
    from .llama_routes import mixed_ids

    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and any(isinstance(p, list) for p in prompt):
        raise bad_request("prompt", "'prompt' holds several prompts: this server answers one per request")
    if not isinstance(prompt, (str, list)):
        raise bad_request("prompt", "'prompt' must be a string, token ids, or an array of strings and token ids")
    ids = mixed_ids(prompt, tokenizer, add_special=True, parse_special=True, field="prompt")
    if not ids:
        raise bad_request("prompt", "'prompt' is empty: give at least one token")
    n_predict = body.get("n_predict", body.get("max_tokens", -1))
    name = "n_predict" if "n_predict" in body else "max_tokens"
    n_predict = int_field({name: n_predict}, name, -1, -1, None)
    if n_predict == 0:
        raise bad_request(name, f"'{name}' must be -1 (to the end of the context) or at least 1")
    n_probs = int_field(body, "n_probs", 0, 0, 20)
    for flag in ("cache_prompt", "return_tokens"):
        if not isinstance(body.get(flag, True), bool):
            raise bad_request(flag, f"'{flag}' must be a boolean")
    req = gen_request(body, "completion", ids, n_ctx, d, None if n_predict == -1 else n_predict, name,
                      default_max=None, logprobs=n_probs or None)
    req.plan = plan_completion(body, ids, tokenizer)
    req.extra = {"prompt": prompt if isinstance(prompt, str) else tokenizer.decode(ids, special=True),
                 "return_tokens": body.get("return_tokens", False), "n_predict": n_predict, "n_probs": n_probs,
                 "grammar": body.get("grammar") if isinstance(body.get("grammar"), str) else ""}
    return req


class LlamaShaper:
    """llama-server's /completion bodies (the calls of clutor.server.responses.Shaper)."""

    done = b""

    def __init__(self, req: GenRequest, rid: str, created: int, model: str, tokenizer):
        self.req, self.rid, self.model, self.tok = req, rid, model, tokenizer
        self.grammar = None
        self._n = 0          # tokens streamed so far

    @staticmethod
    def error(e) -> dict:
        return e.body()

    def stream_error(self, e) -> tuple[None, dict]:
        return None, {"error": e.body()["error"]}

    def _settings(self) -> dict:
        o, x = self.req.options, self.req.extra
        spec = o.get("speculative")
        return {"seed": 4294967295 if o.get("seed") is None else o["seed"], "temperature": o.get("temperature"),
                "top_k": o.get("top_k"), "top_p": o.get("top_p"), "min_p": o.get("min_p"),
                "repeat_last_n": o.get("repeat_last_n"), "repeat_penalty": o.get("repeat_penalty"),
                "presence_penalty": o.get("presence_penalty"), "frequency_penalty": o.get("frequency_penalty"),
                "stop": list(o.get("stop") or []), "max_tokens": x["n_predict"], "n_predict": x["n_predict"],
                "ignore_eos": bool(o.get("ignore_eos")), "stream": self.req.stream, "n_probs": x["n_probs"],
                "grammar": x["grammar"],
                "speculative.types": "none" if spec in (None, "off") else
                (spec.get("mode", "ngram") if isinstance(spec, dict) else str(spec))}

    def _probs(self, chunks) -> list[dict]:
        def one(t: int, lp: float) -> dict:
            b = self.tok.token_bytes(t, special=True)
            return {"id": t, "token": b.decode("utf-8", "replace"), "bytes": list(b), "logprob": lp}

        return [{**one(c.token, c.logprob), "top_logprobs": [one(i, lp) for i, lp in c.top_logprobs or ()]}
                for c in chunks if c.token is not None and c.logprob is not None]

    def _final(self, content: str, tokens: list[int], stats) -> dict:
        t = timings(stats, self.grammar)
        t["prompt_per_token_ms"] = t["prompt_ms"] / t["prompt_n"] if t.get("prompt_n") else 0.0
        t["predicted_per_token_ms"] = t["predicted_ms"] / t["predicted_n"] if t.get("predicted_n") else 0.0
        stop_type = _STOP_TYPES.get(stats.stop_reason, "none")
        return {"index": 0, "content": content, "tokens": tokens if self.req.extra["return_tokens"] else [],
                "id_slot": self.req.id_slot or 0, "stop": True, "model": self.model,
                "tokens_predicted": stats.generated_tokens, "tokens_evaluated": stats.prompt_tokens,
                "generation_settings": self._settings(), "prompt": self.req.extra["prompt"],
                "has_new_line": "\n" in content, "truncated": False, "stop_type": stop_type,
                "stopping_word": getattr(stats, "stop_word", ""),
                "tokens_cached": stats.prompt_tokens + max(stats.generated_tokens - 1, 0), "timings": t}

    # -- whole -------------------------------------------------------------------------------------
    def whole(self, message, chunks, stats) -> dict:
        out = self._final(message.content or "", [c.token for c in chunks if c.token is not None], stats)
        if self.req.logprobs:
            out["completion_probabilities"] = self._probs(chunks)
        return out

    # -- stream ------------------------------------------------------------------------------------
    def open(self) -> list:
        return []

    def delta(self, d, chunks) -> list:
        toks = [c.token for c in chunks if c.token is not None]
        self._n += len(toks)
        if not d.content and not toks:
            return []
        ev = {"index": 0, "content": d.content or "", "tokens": toks, "stop": False, "id_slot": -1,
              "tokens_predicted": self._n, "tokens_evaluated": len(self.req.ids)}
        if self.req.logprobs and chunks:
            ev["completion_probabilities"] = self._probs(chunks)
        return [(None, ev)]

    def close(self, message, stats) -> list:
        return [(None, self._final("", [], stats))]
