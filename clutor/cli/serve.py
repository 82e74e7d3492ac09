"""clutor serve MODEL: an OpenAI-compatible HTTP server (chat and text completions, tool calls,
structured output, the Responses and Anthropic Messages APIs, embeddings; a chat page at /).

The port is open at once; /health answers 503 until the model is loaded, then 200. SIGINT/SIGTERM
drains the requests in flight (at most --drain-timeout seconds), then exits. Needs the server extra:
pip install 'clutor[server]'."""
from __future__ import annotations

import logging
import os
import sys

from ..errors import ClutorError
from ..model.sampling import SamplingParams
from ..server.limits import Limits
from .common import add_command, add_model_args, model_kwargs
from .source import add_model_source


def add_parser(sub):
    p = add_command(sub, "serve", "OpenAI-compatible HTTP server", __doc__,
                    "clutor serve olmoe.gguf --expert-cache 3GiB --port 8000",
                    "curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\\n"
                    "       -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"stream\": true}'")
    add_model_source(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 = every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free one, printed at start)")
    p.add_argument("-a", "--alias", "--served-model-name", dest="served_model_name", default=None, metavar="NAME",
                   help="the model's id in /v1/models and in responses (default: the file's name, clutor-demo for "
                        "the demo model); requests may name any model: the one served answers")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="where POST /slots/{id}?action=save|restore (llama-server's) write and read a slot's KV "
                        "pages; a save writes the pages the prefix cache still holds (--prefix-cache in RAM, all "
                        "with --prefix-cache-disk) of the slot's last request (default: those answer 501)")
    p.add_argument("--api-key", default=os.environ.get("CLUTOR_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $CLUTOR_API_KEY, else none)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let browser pages from ORIGIN call the API (CORS; repeatable, '*' = any); pages from any "
                        "other origin are refused (403)")
    p.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                   help="on a loopback address, accept requests for the Host name HOST too (repeatable, '*' = any); "
                        "by default only local names and IP addresses, against DNS rebinding")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting beyond the --max-sequences in the batch; more get 429")
    lim = Limits()
    p.add_argument("--max-body", type=int, default=lim.max_body, help="largest request body, bytes (more: 413)")
    p.add_argument("--max-head", type=int, default=lim.max_head,
                   help="largest request line and headers, bytes (more: 431)")
    p.add_argument("--max-headers", type=int, default=lim.max_headers, help="most header lines (more: 431)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at once; more get 503 (default: from the file-descriptor limit, at most 1024)")
    p.add_argument("--header-timeout", type=float, default=lim.header_timeout,
                   help="seconds a client has to send a request's headers (then 408 and closed)")
    p.add_argument("--body-timeout", type=float, default=lim.body_timeout,
                   help=f"seconds a client has to send a request's body, plus one per {lim.min_body_rate >> 10} KiB sent")
    p.add_argument("--write-timeout", type=float, default=lim.write_timeout,
                   help="seconds a client may read nothing while its response waits; then it is cut off")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds requests in flight may still run")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--reasoning-format", default="auto", choices=("auto", "deepseek", "none"),
                   help="auto/deepseek: a thinking model's reasoning goes in reasoning_content, apart from the "
                        "content; none: left in the content as the model wrote it (as llama-server's)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the model file's own")
    p.add_argument("--special-in-content", action="store_true",
                   help="parse control-token texts (<|im_start|>, <|endoftext|>) in messages and tools as tokens, "
                        "as llama-server does; by default they are text, and only the template's markup is tokens")
    p.add_argument("--pooling", default="mean", choices=("mean", "last"),
                   help="how /v1/embeddings pools a text's final hidden states")
    p.add_argument("--no-webui", action="store_true", help="do not serve the chat page at /")
    g = p.add_argument_group("defaults for requests that omit a sampling field")
    g.add_argument("--temperature", type=float, default=SamplingParams.temperature)
    g.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    g.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    g.add_argument("--min-p", type=float, default=SamplingParams.min_p)
    g.add_argument("--repeat-penalty", type=float, default=SamplingParams.repeat_penalty)
    g.add_argument("--repeat-last-n", type=int, default=SamplingParams.repeat_last_n)
    g.add_argument("--presence-penalty", type=float, default=SamplingParams.presence_penalty)
    g.add_argument("--frequency-penalty", type=float, default=SamplingParams.frequency_penalty)
    add_model_args(p)
    return p


def model_id(path: str) -> str:
    """The id a served file gets by default: its name without .gguf and without a split suffix
    (-00001-of-00003); the demo model's (demo-FINGERPRINT.gguf in Clutor's cache) is clutor-demo."""
    import re

    from .demo_model import DEMO

    name = os.path.basename(path)
    if re.fullmatch(rf"{re.escape(DEMO.name)}-[0-9a-f]{{16}}\.gguf", name):
        return "clutor-demo"
    name = re.sub(r"-\d{5}-of-\d{5}\.gguf$", "", name)
    return name[:-5] if name.endswith(".gguf") else name


def _server_modules():
    try:
        from ..server import Defaults, create_app
        from ..server.run import Server, bind
    except ImportError as e:
        raise ClutorError(f"clutor serve needs the server extra ({e.name} is missing): "
                          "pip install 'clutor[server]'") from None
    return Defaults, create_app, Server, bind


def _limits(args) -> Limits:
    try:
        return Limits(max_body=args.max_body, max_head=args.max_head, max_headers=args.max_headers,
                      max_connections=args.max_connections,
                      header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                      write_timeout=args.write_timeout)
    except ValueError as e:  # "Limits.header_timeout must be a positive number, got 0.0"
        flag = "--" + str(e).split(" ", 1)[0].split(".", 1)[1].replace("_", "-")
        raise ClutorError(f"{flag}: {str(e).split(' ', 1)[1]}") from None


async def run(args) -> int:
    from ..model.model import Model

    Defaults, create_app, Server, bind = _server_modules()
    if args.max_sequences < 1 or args.max_queue < 0:
        raise ClutorError("--max-sequences must be >= 1 and --max-queue >= 0")
    limits = _limits(args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        raise ClutorError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    failed: list[BaseException] = []
    server = None

    async def open_model():
        try:
            return await Model.open(args.model, **model_kwargs(args))
        except Exception as e:  # a bad file or budget: stop serving and report it like any command
            failed.append(e)
            server.should_exit = True
            raise

    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ClutorError(f"--chat-template {args.chat_template}: {e.strerror}") from None
    if args.slot_save_path is not None:
        try:
            os.makedirs(args.slot_save_path, exist_ok=True)
        except OSError as e:
            raise ClutorError(f"--slot-save-path {args.slot_save_path}: cannot create it ({e.strerror})") from None
    defaults = Defaults(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                        reasoning_format=args.reasoning_format, chat_template=template,
                        special_in_content=args.special_in_content)
    app = create_app(open_model(), served_model_name=args.served_model_name or model_id(args.model),
                     api_key=args.api_key or None,
                     max_sequences=args.max_sequences, max_queue=args.max_queue, defaults=defaults,
                     cors_origins=tuple(args.allow_origin), allowed_hosts=tuple(args.allow_host), limits=limits,
                     pooling=args.pooling, web_ui=not args.no_webui, freeze_heap=True,
                     slot_save_path=args.slot_save_path)
    server = Server(app, drain_timeout=args.drain_timeout, log_level=args.log_level)
    from ..server.run import SWITCH_INTERVAL

    sys.setswitchinterval(SWITCH_INTERVAL)  # the loop and the compute thread take shorter turns on the GIL
    host, port = sock.getsockname()[:2]
    logging.getLogger("clutor.server").info(
        "listening on http://%s:%d (loading %s%s)", host if ":" not in host else f"[{host}]", port, args.model,
        ", API key required" if args.api_key else "")
    await server.serve(sockets=[sock])
    if failed:
        raise failed[0] if isinstance(failed[0], ClutorError) else ClutorError(f"{args.model}: {failed[0]}")
    return 0
