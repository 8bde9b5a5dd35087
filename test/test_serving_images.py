"""Images through the HTTP server and the real `openai` client: a base64 data: URL, a local file and an http URL
(a loopback file server) in chat messages give exactly the tokens of the same request run in-process; every
bad image (undecodable, too large, unreachable, 404, endless or slow http answers) answers 400 naming the
problem, and the server keeps serving. `bench_serving --workload random-mm` runs briefly against the same server,
checked against the prompt lengths and token counts the server reports."""

from __future__ import annotations

import base64
import http.server
import io
import json
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from mm_fixtures import IMAGE, VIDEO, processor_of, seeded_image
from PIL import Image, ImageSequence
from serving_fixtures import MODEL_ARGS, start_server
from test_bench_serving import SCRIPT, bench
from torch_threads import one_torch_thread
from transformers import AutoTokenizer

from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.model_executor.model_runner import ModelRunner
from srt.multimodal.video import Video
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.tools.make_checkpoint import make_checkpoint

CONTEXT = 2048
MAX_TOKENS = 6
FETCH_TIMEOUT_S = 2


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint("tiny-gemma-4-E4B-it", tmp_path_factory.mktemp("mm-serving"), multimodal=True)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "photo.png").write_bytes(png_bytes(seeded_image(80, 64, seed=2)))
    return folder


class MediaHandler(http.server.BaseHTTPRequestHandler):
    """/photo.png: an image; /huge: an endless body; /slow: an image after longer than the fetch timeout."""

    def do_GET(self) -> None:
        if self.path == "/photo.png":
            body = self.server.photo
        elif self.path == "/slow":
            time.sleep(FETCH_TIMEOUT_S + 1)
            body = self.server.photo
        elif self.path == "/huge":
            self.send_response(200)
            self.end_headers()
            try:
                while True:  # no Content-Length, no end: the fetch must stop at its cap
                    self.wfile.write(b"\0" * (1 << 20))
            except OSError:
                return
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def media_url(media):
    """Base URL of a loopback HTTP server of test media."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MediaHandler)
    httpd.daemon_threads = True
    httpd.photo = (media / "photo.png").read_bytes()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(model, media, tmp_path_factory):
    log = tmp_path_factory.mktemp("serving-images") / "server.log"
    server = start_server(
        model, log, "--context-length", str(CONTEXT), "--allowed-local-media-path", str(media),
        "--media-fetch-timeout", str(FETCH_TIMEOUT_S),
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(client, model, parts: list[dict]) -> str:
    reply = client.chat.completions.create(
        model=str(model), messages=[{"role": "user", "content": parts}], max_tokens=MAX_TOKENS, temperature=0.0
    )
    return reply.choices[0].message.content


def in_process_text(
    model, text_parts: list[str], images: list[Image.Image], videos: list[Video] | None = None, kwargs=None
) -> str:
    """The same chat run by a Scheduler in this process (same model arguments): the expected reply."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    kinds = {IMAGE: "image", VIDEO: "video"}
    content = [{"type": kinds[part]} if part in kinds else {"type": "text", "text": part} for part in text_parts]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids, mm = processor_of(model).process(prompt, images, False, kwargs, videos)
    args = ServerArgs(model_path=str(model), **{**MODEL_ARGS, "context_length": CONTEXT})
    with one_torch_thread():
        scheduler = Scheduler(args, ModelRunner(args))
        params = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS)
        result = run_to_completion(scheduler, [TokenizedGenerateReq("ref", ids, params, mm_inputs=mm)])["ref"]
    return tokenizer.decode(result.output_ids, skip_special_tokens=True)


def test_chat_with_a_data_url_a_local_file_and_an_http_url(client, model, media, media_url) -> None:
    image = seeded_image(96, 64, seed=1)
    parts = [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}},
        {"type": "text", "text": "and in"},
        {"type": "image_url", "image_url": {"url": f"file://{media / 'photo.png'}"}},
        {"type": "text", "text": "and there"},
        {"type": "image_url", "image_url": {"url": f"{media_url}/photo.png"}},
    ]
    photo = Image.open(media / "photo.png")
    texts = ["What is in", IMAGE, "and in", IMAGE, "and there", IMAGE]
    assert chat(client, model, parts) == in_process_text(model, texts, [image, photo, photo])


def test_chat_with_a_video_url(client, model) -> None:
    """An animated GIF as a video_url part, 4 frames sampled (mm_processor_kwargs, vLLM's extra field)."""
    frames = [seeded_image(64, 48, seed=70 + i) for i in range(6)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=250, loop=0)
    decoded = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(io.BytesIO(buffer.getvalue())))]
    kwargs = {"max_soft_tokens": 70, "num_frames": 4}
    url = "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]
    reply = client.chat.completions.create(
        model=str(model),
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"mm_processor_kwargs": kwargs},
    )
    video = Video(np.stack(decoded), fps=4.0)
    expected = in_process_text(model, [VIDEO, "What happens?"], [], [video], kwargs)
    assert reply.choices[0].message.content == expected
    bad = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError, match="video_data\\[0\\]: the video cannot be decoded"):
        client.chat.completions.create(model=str(model), messages=[{"role": "user", "content": bad}], max_tokens=2)


def bad_images(media, media_url) -> dict[str, tuple[str, str]]:
    """name -> (image URL, a phrase the 400 must contain)."""
    good = png_bytes(seeded_image(64, 64, seed=3))
    huge = io.BytesIO()
    Image.new("1", (9000, 8000)).save(huge, format="PNG")  # 72M pixels, a small file
    outside = media.parent / "outside.png"
    outside.write_bytes(good)
    return {
        "not an image": (data_url(b"this is text, not a picture"), "cannot be decoded"),
        "truncated": (data_url(good[: len(good) // 2]), "cannot be decoded"),
        "too large": (data_url(huge.getvalue()), "too large"),
        "unreachable host": ("http://127.0.0.1:9/nothing.png", "failed"),
        "http 404": (f"{media_url}/missing.png", "HTTP 404"),
        "endless http body": (f"{media_url}/huge", "too large"),
        "slow http answer": (f"{media_url}/slow", f"longer than {FETCH_TIMEOUT_S} s"),
        "outside the allowed folder": (f"file://{outside}", "outside --allowed-local-media-path"),
        "missing file": (f"file://{media / 'missing.png'}", "does not exist"),
        "bad base64": ("data:image/png;base64,@@@@", "not valid base64"),
    }


def test_bad_images_answer_400_and_the_server_keeps_serving(server, client, model, media, media_url) -> None:
    for name, (url, phrase) in bad_images(media, media_url).items():
        parts = [{"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": url}}]
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, model, parts)
        assert phrase in str(caught.value), name
    # more images than placeholders, on the native route
    body = {"text": "no placeholder here", "image_data": [data_url(png_bytes(seeded_image(64, 64, 4)))]}
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert reply.status_code == 400 and "1 images were sent" in reply.text
    # still serving, images included
    image = seeded_image(64, 80, seed=5)
    parts = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}}]
    assert chat(client, model, parts) == in_process_text(model, [IMAGE], [image])


def test_generate_with_image_data_and_a_soft_token_budget(server, model) -> None:
    image = seeded_image(96, 96, seed=6)
    body = {
        "text": f"Tell me about {IMAGE}",
        "image_data": [data_url(png_bytes(image))],
        "mm_processor_kwargs": {"max_soft_tokens": 70},
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
    }
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    ids, _ = processor_of(model).process(body["text"], [image], mm_processor_kwargs={"max_soft_tokens": 70})
    assert reply["meta_info"]["prompt_tokens"] == len(ids)
    bad = {**body, "mm_processor_kwargs": {"max_soft_tokens": 100}}
    reply = httpx.post(f"{server.url}/generate", json=bad, timeout=60)
    assert reply.status_code == 400 and "max_soft_tokens" in reply.text


def test_random_mm_workload_sends_its_images_through_chat(server, model, tmp_path) -> None:
    """`--workload random-mm`, shrunk to 3 images of 64x48 per request and 3 output tokens: every request
    succeeds, the server generated exactly the tokens asked for, and the prompt it counted for each request is
    the chat template of the script's text with its images expanded by the image processor."""
    argv = [
        "--workload", "random-mm", "--num-prompts", "3", "--max-concurrency", "2", "--warmup-requests", "1",
        "--random-image-count", "3", "--random-image-size", "64x48", "--random-output-len", "3",
    ]  # fmt: skip
    before = httpx.get(f"{server.url}/server_info", timeout=30).json()["generated_tokens_total"]
    out = tmp_path / "random-mm.json"
    command = [sys.executable, str(SCRIPT), "--base-url", server.url, "--output-json", str(out), "--disable-tqdm"]
    done = subprocess.run([*command, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["config"]["backend"] == "chat" and report["config"]["random_image_size"] == [64, 48]
    metrics = report["metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (3, 0, 9)
    after = httpx.get(f"{server.url}/server_info", timeout=30).json()["generated_tokens_total"]
    assert after - before == (3 + 1) * 3  # the warm-up request too

    # the requests the script drew (seed 0), rebuilt here, and the prompt lengths they must have on the server
    args = bench.parse_args(argv)
    run = args.runs[0]
    timed, _ = bench.build_requests(args, run, report["config"]["vocab_size"], str(model))
    tokenizer, processor = AutoTokenizer.from_pretrained(model), processor_of(model)
    for spec, record in zip(timed, report["requests"], strict=True):
        assert len(spec.images) == 3
        images = [Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))) for url in spec.images]
        assert {image.size for image in images} == {(64, 48)}
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": spec.prompt}]
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids, mm = processor.process(prompt, [image.convert("RGB") for image in images], add_special_tokens=False)
        assert len(mm.items) == 3 and record["input_len"] == len(ids)
