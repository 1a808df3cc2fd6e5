"""vLLM's front end per decode step, against batch size B: the engine-core outputs' transport
(msgpack encode in the engine core's output thread, decode in the front end), `OutputProcessor.
process_outputs` for B streaming requests with incremental detokenisation, and the OpenAI server's
per-token stream chunk.

What vLLM's API server runs for every engine step (vllm/v1/engine/async_llm.py, `output_handler`):
decode the EngineCoreOutputs from the engine core, `OutputProcessor.process_outputs` (per request:
its incremental detokenizer, the RequestOutput, pushed to the request's RequestOutputCollector; per
step: the IterationStats a server with stats on records), then each request's completion stream
handler (vllm/entrypoints/openai/completion/serving.py) builds a `CompletionStreamResponse` and
`model_dump_json`s it into an SSE `data:` line. The engine core's side of the transport is
`MsgpackEncoder.encode` (vllm/v1/serial_utils.py) in its output thread.

No tokenizer can be downloaded, so tokenizers are built here with `tokenizers` and saved as a
`PreTrainedTokenizerFast`, then loaded through vLLM's own `get_tokenizer` (which caches what vLLM
caches): a byte-level BPE (Llama-3's, Qwen2's and Mistral-Nemo's decoder) with synthetic vocabularies
of 32k, 128k and 152k entries (`bpe32k`, `bpe128k`, `bpe152k`), and a 32k one with Llama-2's
SentencePiece-style decoder (`spm32k`: Replace("▁", " "), ByteFallback, Fuse, Strip). vLLM picks its
`FastIncrementalDetokenizer` (tokenizers' DecodeStream) for all of them. Generated tokens are drawn
uniformly from each vocabulary (byte tokens included, so some steps emit no text until a character
completes).

Each request: a 512-token prompt, `output_kind=DELTA` (streaming), `detokenize=True`, ignore_eos, no
stop strings. Each timed step feeds one new token to each of the B requests. All (tokenizer, B) cases take turns
step by step (in a new random order each round), so that the shared machine's changing speed falls on
all of them alike.

Writes `output_<version>.csv` (tokenizer, B, part: encode, decode, process_outputs, sse_chunk,
front_end = decode + process_outputs + sse_chunk) and `output_<version>.json`.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 /work/venvs/vllm/bin/python experiments/host_overhead/output_processor.py
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BATCHES, QUIET, machine, stats_us, version_tag, write_csv, write_meta  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
TOKENIZERS = {"bpe32k": ("bytelevel", 32_000), "bpe128k": ("bytelevel", 128_256), "bpe152k": ("bytelevel", 152_064),
              "spm32k": ("sentencepiece", 32_000)}
PROMPT = 512
FIRST_ID = 3  # ids below are the special tokens


def build_tokenizer(kind: str, size: int) -> str:
    """A fast tokenizer of `size` ids saved to a temporary folder; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(size)
    letters = "abcdefghijklmnopqrstuvwxyz"
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    if kind == "bytelevel":
        for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
            vocab[ch] = len(vocab)
        space = "Ġ"
    else:  # SentencePiece-style: <0xNN> byte-fallback pieces, words starting with ▁
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
        space = "▁"
    while len(vocab) < size:
        w = (space if rng.random() < 0.6 else "") + "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        vocab.setdefault(w, len(vocab))
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    folder = tempfile.mkdtemp(prefix=f"tok-{kind}-{size}-")
    fast.save_pretrained(folder)
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=size).save_pretrained(folder)  # get_tokenizer reads the model type (else it retries)
    return folder


def _fields(cls, **kw):
    names = set(getattr(cls, "__struct_fields__", ()))
    return {k: v for k, v in kw.items() if k in names}


def setup_case(tokenizer, B, rng, vocab_size):
    """An OutputProcessor holding B streaming requests, each with its output collector."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    proc = OutputProcessor(tokenizer, log_stats=True)
    ids = [f"cmpl-{B}-{i}" for i in range(B)]
    queues = {}
    for rid in ids:
        sp = SamplingParams(max_tokens=4096, ignore_eos=True, output_kind=RequestOutputKind.DELTA, detokenize=True)
        if hasattr(sp, "update_from_tokenizer"):
            sp.update_from_tokenizer(tokenizer)
        prompt = [rng.randrange(FIRST_ID, vocab_size) for _ in range(PROMPT)]
        req = EngineCoreRequest(**_fields(EngineCoreRequest, request_id=rid, prompt_token_ids=prompt, mm_features=None,
                                          sampling_params=sp, pooling_params=None, eos_token_id=tokenizer.eos_token_id,
                                          arrival_time=time.time(), lora_request=None, cache_salt=None,
                                          data_parallel_rank=None))
        req.external_req_id = rid  # as InputProcessor.assign_request_id sets it (internal id = external id here)
        q = RequestOutputCollector(RequestOutputKind.DELTA, rid)
        queues[rid] = q
        proc.add_request(req, None, None, 0, q)
    return proc, ids, queues


PARTS = ("encode", "decode", "process_outputs", "sse_chunk", "front_end")


def run_cases(toks: dict, batches: list[int], steps: int, warmup: int, rng):
    """B streaming requests per tokenizer and batch size; every round runs each (tokenizer, B) case
    once, in a new random order each round, so that the machine's changing speed (a shared, loaded
    machine) falls on all cases alike. Returns {(tokenizer, B): ({part: wall ns}, {part: CPU ns})}."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    keys = [(name, B) for B in batches for name in toks]
    cases = {(name, B): setup_case(toks[name][0], B, rng, toks[name][1]) for name, B in keys}
    created = int(time.time())
    res = {key: ({k: [] for k in PARTS}, {k: [] for k in PARTS}) for key in keys}
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    order, shuffle = list(keys), random.Random(1).shuffle
    gc.collect()
    gc.freeze()  # as vLLM's API server freezes its heap after start-up (freeze_gc_heap, api_server.py)
    with QUIET():
        for k in range(warmup + steps):
            shuffle(order)  # a new order each round: no case always follows the same (e.g. the largest) one
            for key in order:
                proc, ids, queues = cases[key]
                size = toks[key[0]][1]
                # the youngest generation collected before each case (not timed), so that a collection
                # owed to the previous case's allocations does not land in this one's timing
                gc.collect(0)
                eco = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=rid,
                                                                  new_token_ids=[rng.randrange(FIRST_ID, size)])
                                                 for rid in ids],
                                        scheduler_stats=SchedulerStats(num_running_reqs=key[1]),
                                        timestamp=time.monotonic())
                c0, t0 = tt(), pc()
                frames = encoder.encode(eco)
                t1, c1 = pc(), tt()
                got = decoder.decode(frames)
                t2, c2 = pc(), tt()
                out = proc.process_outputs(got.outputs, got.timestamp, IterationStats())
                t3, c3 = pc(), tt()
                assert not out.request_outputs and not out.reqs_to_abort
                # each stream's handler: take its RequestOutput, send one SSE chunk (serving.py L454-484)
                for rid in ids:
                    ro = queues[rid].get_nowait()
                    if ro is None:
                        continue
                    o = ro.outputs[0]
                    chunk = CompletionStreamResponse(id=rid, created=created, model="model", choices=[
                        CompletionResponseStreamChoice(index=0, text=o.text, logprobs=None,
                                                       finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                                       prompt_token_ids=None, token_ids=None)])
                    _ = f"data: {chunk.model_dump_json(exclude_unset=False)}\n\n"
                t4, c4 = pc(), tt()
                if k >= warmup:
                    wall, cpu = res[key]
                    for part, (w, c) in zip(PARTS, ((t1 - t0, c1 - c0), (t2 - t1, c2 - c1), (t3 - t2, c3 - c2),
                                                    (t4 - t3, c4 - c3), (t4 - t1, c4 - c1))):
                        wall[part].append(w)
                        cpu[part].append(c)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--tokenizers", default=",".join(TOKENIZERS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    from vllm.tokenizers import get_tokenizer

    os.makedirs(a.out, exist_ok=True)
    meta = machine()
    meta.update(steps=a.steps, warmup=a.warmup, prompt_tokens=PROMPT, command=" ".join(sys.argv), detokenizers={})
    rows = []
    toks = {}
    for name in a.tokenizers.split(","):
        kind, size = TOKENIZERS[name]
        toks[name] = (get_tokenizer(build_tokenizer(kind, size)), size)
        meta["detokenizers"][name] = detokenizer_class(toks[name][0])
    rng = random.Random(0)
    res = run_cases(toks, list(map(int, a.batches.split(","))), a.steps, a.warmup, rng)
    for (name, B), (wall, cpu) in sorted(res.items(), key=lambda kv: (list(toks).index(kv[0][0]), kv[0][1])):
        for part in PARTS:
            rows.append(dict(vllm=meta["vllm"], tokenizer=name, vocab=toks[name][1], batch=B, part=part,
                             **stats_us(wall[part], cpu[part])))
        by = {r["part"]: (r["median_us"], r["cpu_median_us"]) for r in rows[-len(PARTS):]}
        print(f"{name} B={B} (wall, CPU): " + ", ".join(f"{k} {v} us" for k, v in by.items()), flush=True)
    meta["loads"] = QUIET.summary()
    tag = version_tag()
    write_csv(os.path.join(a.out, f"output_{tag}.csv"), rows)
    write_meta(os.path.join(a.out, f"output_{tag}.json"), meta)
    print(QUIET.summary())


def detokenizer_class(tok) -> str:
    """Which incremental detokenizer vLLM builds for this tokenizer (IncrementalDetokenizer.from_new_request)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    sp = SamplingParams(max_tokens=4, detokenize=True)
    if hasattr(sp, "update_from_tokenizer"):
        sp.update_from_tokenizer(tok)
    req = EngineCoreRequest(**_fields(EngineCoreRequest, request_id="x", prompt_token_ids=[5, 6, 7], mm_features=None,
                                      sampling_params=sp, pooling_params=None, eos_token_id=2, arrival_time=0.0,
                                      lora_request=None, cache_salt=None, data_parallel_rank=None))
    req.external_req_id = "x"
    return type(IncrementalDetokenizer.from_new_request(tok, req)).__name__


if __name__ == "__main__":
    main()
