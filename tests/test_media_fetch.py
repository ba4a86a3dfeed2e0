"""flagdeploy.media: a request's media URL to checked bytes, and bytes to RGB pixels (issue 30).

Images are made with Pillow and videos with PyAV in the test, sent as data: URLs or served by a real
HTTP server on loopback; what comes back is compared pixel for pixel (exactly for lossless formats).
Each refusal is checked for its code and for a message that names the item and the limit.
"""

from __future__ import annotations

import base64
import io
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote_from_bytes

import numpy as np
import pytest
from PIL import Image, ImageFile

from flagdeploy.errors import FlagdeployError
from flagdeploy.media import (
    FetchLimits,
    MediaError,
    content_hash,
    decode_image,
    decode_video,
    fetch_bytes,
)
from flagdeploy.media_policy import MediaPolicy

WHAT = "Image 2 of this request"
LIMITS = FetchLimits()
DATA_ONLY = MediaPolicy()
COLOURS = [(255, 0, 0), (0, 200, 0), (0, 0, 255), (240, 240, 0)]


def quadrants(w: int = 32, h: int = 24, mode: str = "RGB") -> Image.Image:
    """Four flat colours, so that every format (a GIF's palette too) can hold them exactly."""
    image = Image.new(mode, (w, h))
    for i, colour in enumerate(COLOURS):
        x, y = i % 2 * w // 2, i // 2 * h // 2
        image.paste(colour if mode == "RGB" else (*colour, 255), (x, y, x + w // 2, y + h // 2))
    return image


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def noise_png(w: int = 64, h: int = 64) -> bytes:
    return encode(Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)), "PNG")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def refused(code: str, fn, *args) -> str:
    with pytest.raises(MediaError) as info:
        fn(*args)
    assert info.value.code == code, str(info.value)
    assert isinstance(info.value, (FlagdeployError, ValueError))
    return str(info.value)


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


# ---- data: URLs and images ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,kw,media_type", [
    ("PNG", {}, "image/png"), ("WEBP", {"lossless": True}, "image/webp"), ("GIF", {}, "image/gif"),
    ("BMP", {}, "image/bmp"), ("JPEG", {"quality": 95, "subsampling": 0}, "image/jpeg"),
])
def test_data_url_images_decode_to_their_pixels(fmt, kw, media_type):
    original = quadrants()
    data = fetch_bytes(data_url(encode(original, fmt, **kw), media_type), DATA_ONLY, LIMITS, WHAT)
    image = decode_image(data, LIMITS, WHAT)
    assert image.mode == "RGB" and image.size == original.size
    diff = np.abs(pixels(image) - pixels(original))
    assert diff.max() <= (3 if fmt == "JPEG" else 0)


def test_data_url_spellings():
    png = encode(quadrants(), "PNG")
    b64 = base64.b64encode(png).decode()
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)).rstrip("=")
    for url in (f"data:image/png,{quote_from_bytes(png)}",  # percent-encoded, not base64
                f"data:;base64,{b64}",  # no media type
                f"  DATA:image/png;base64,{wrapped}",  # wrapped, unpadded, upper-case scheme
                f"data:image/png;base64,{quote_from_bytes(b64.encode())}"):
        assert fetch_bytes(url, DATA_ONLY, LIMITS, WHAT) == png


def test_transparency_is_composited_onto_white():
    rgba = Image.new("RGBA", (3, 1))
    rgba.putdata([(255, 0, 0, 0), (255, 0, 0, 255), (0, 0, 255, 128)])
    image = decode_image(encode(rgba, "PNG"), LIMITS, WHAT)
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 255, 255) and image.getpixel((1, 0)) == (255, 0, 0)
    r, g, b = image.getpixel((2, 0))
    assert abs(r - 127) <= 1 and abs(g - 127) <= 1 and b == 255
    palette = quadrants().quantize(4)  # a GIF whose first colour is transparent
    index = palette.getpixel((0, 0))
    gif = decode_image(encode(palette, "GIF", transparency=index), LIMITS, WHAT)
    assert gif.getpixel((0, 0)) == (255, 255, 255) and gif.getpixel((31, 23)) == COLOURS[3]


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    image = decode_image(encode(quadrants(40, 20), "JPEG", exif=exif), LIMITS, WHAT)
    assert image.size == (20, 40)


def test_gif_first_frame():
    frames = [Image.new("RGB", (8, 8), colour) for colour in COLOURS]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(data, LIMITS, WHAT).getpixel((4, 4)) == COLOURS[0]


# ---- refusals ------------------------------------------------------------------------------------------


def test_too_many_bytes():
    small = FetchLimits(max_bytes=1000)
    png = noise_png()
    message = refused("media_too_large", fetch_bytes, data_url(png), DATA_ONLY, small, WHAT)
    assert f"{WHAT} is {len(png) / 1024:.1f} KB; this server takes at most 1000 bytes per medium" in message
    message = refused("media_too_large", fetch_bytes, data_url(b"x" * (31 * 2**20)), DATA_ONLY, LIMITS, WHAT)
    assert "is 31 MB; this server takes at most 20 MB per medium" in message


def test_too_many_pixels_is_refused_from_the_header(monkeypatch):
    png = encode(Image.new("RGB", (5000, 5000)), "PNG")
    assert len(png) < 100_000  # small compressed, 75 MB decoded

    def load(self):
        raise AssertionError("pixels decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    monkeypatch.setattr(Image.Image, "load", load)
    message = refused("media_too_large", decode_image, png, LIMITS, WHAT)
    assert WHAT in message and "5000x5000" in message and f"{4096 * 4096:,}" in message


def test_damaged_and_foreign_images():
    png = noise_png()
    message = refused("media_corrupt", decode_image, png[:len(png) // 2], LIMITS, WHAT)
    assert WHAT in message and "PNG" in message and "damaged" in message
    assert "PNG" in refused("media_corrupt", decode_image, png[:12], LIMITS, WHAT)  # a cut-off header
    tiff = encode(quadrants(), "TIFF")
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
    for data in (b"just some text, not an image", tiff, svg, b""):
        message = refused("media_unsupported_format", decode_image, data, LIMITS, WHAT)
        assert WHAT in message and "PNG, JPEG, WEBP, GIF or BMP" in message


def test_data_urls_refused():
    message = refused("media_unsupported_format", fetch_bytes, data_url(b"hello", "text/plain"),
                      DATA_ONLY, LIMITS, WHAT)
    assert "'text/plain'" in message and "image/png" in message
    message = refused("media_corrupt", fetch_bytes, "data:image/png;base64,iVBO%%*!w0KGgo", DATA_ONLY, LIMITS, WHAT)
    assert "base64" in message
    assert "comma" in refused("media_corrupt", fetch_bytes, "data:image/png;base64", DATA_ONLY, LIMITS, WHAT)


def test_urls_the_policy_does_not_take():
    policy = MediaPolicy.parse(domains="img.example.com")
    message = refused("media_url_not_allowed", fetch_bytes, "https://evil.example.com/a.png", policy, LIMITS, WHAT)
    assert WHAT in message and "'evil.example.com'" in message and "img.example.com" in message
    message = refused("media_url_not_allowed", fetch_bytes, "https://img.example.com/a.png", DATA_ONLY, LIMITS, WHAT)
    assert "data: URLs only" in message
    for url in ("file:///etc/passwd", "/etc/passwd", "ftp://img.example.com/a.png",
                "https://user@img.example.com/a.png"):
        assert "--allowed-media-domains" in refused("media_url_not_allowed", fetch_bytes, url, policy, LIMITS, WHAT)


def test_content_hash():
    png = noise_png()
    assert content_hash(png) == content_hash(bytes(png)) and len(content_hash(png)) == 64
    assert content_hash(png) != content_hash(png[:-1]) != content_hash(b"")


# ---- http(s) -------------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    png = encode(quadrants(), "PNG")

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        try:
            getattr(self, "route_" + self.path.strip("/").replace("-", "_"), self.route_missing)()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def route_ok(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.png)))
        self.end_headers()
        self.wfile.write(self.png)

    def route_missing(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def route_moved(self) -> None:
        self.send_response(302)
        self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def route_endless(self) -> None:  # chunked, no Content-Length, until the client hangs up (or 20 s)
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"x" * 65536
        stop = time.monotonic() + 20
        while time.monotonic() < stop:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))

    def route_huge(self) -> None:  # declares more than the limit up front
        self.send_response(200)
        self.send_header("Content-Length", str(10**9))
        self.end_headers()
        self.wfile.write(b"x" * 1024)

    def route_slow(self) -> None:  # answers after 2 s
        time.sleep(2)
        self.route_ok()

    def route_trickle(self) -> None:  # a byte every 0.1 s: each read is quick, the whole is not
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        for _ in range(100):
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def loopback(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    return MediaPolicy.parse(domains="127.0.0.1")


def test_http_fetch(server, loopback):
    data = fetch_bytes(f"{server}/ok", loopback, LIMITS, WHAT)
    assert data == Handler.png
    assert np.array_equal(pixels(decode_image(data, LIMITS, WHAT)), pixels(quadrants()))


def test_http_refusals(server, loopback):
    message = refused("media_fetch_failed", fetch_bytes, f"{server}/missing", loopback, LIMITS, WHAT)
    assert WHAT in message and "404" in message
    message = refused("media_fetch_failed", fetch_bytes, f"{server}/moved", loopback, LIMITS, WHAT)
    assert "302" in message and "redirect" in message and "169.254.169.254" in message
    small = FetchLimits(max_bytes=100_000, timeout_s=30)
    start = time.monotonic()
    message = refused("media_too_large", fetch_bytes, f"{server}/endless", loopback, small, WHAT)
    assert "more than" in message and "97.7 KB" in message and time.monotonic() - start < 10
    message = refused("media_too_large", fetch_bytes, f"{server}/huge", loopback, small, WHAT)
    assert "953.7 MB" in message


@pytest.mark.parametrize("path", ["slow", "trickle"])
def test_http_timeout(server, loopback, path):
    start = time.monotonic()
    message = refused("media_fetch_failed", fetch_bytes, f"{server}/{path}", loopback, FetchLimits(timeout_s=0.5), WHAT)
    assert "0.5 s" in message and time.monotonic() - start < 1.5


def test_unreachable_host(loopback):
    message = refused("media_fetch_failed", fetch_bytes, "http://127.0.0.1:9/a.png", loopback, LIMITS, WHAT)
    assert WHAT in message and "http://127.0.0.1:9/a.png" in message


# ---- video ---------------------------------------------------------------------------------------------

VIDEO = "Video 1 of this request"


class Unseekable(io.RawIOBase):
    """Where a live recorder writes: it cannot go back to fill in the duration."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.data += b
        return len(b)


def make_video(av, fmt: str = "mp4", codec: str = "mpeg4", seconds: int = 3, fps: int = 10,
               size: tuple[int, int] = (64, 48), streamed: bool = False) -> bytes:
    """`seconds` of solid colour at `fps`, the colour changing each second (COLOURS in turn);
    `streamed`: written as a live recorder writes it, with no duration in its header."""
    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV has no {codec} encoder")
    buf = Unseekable() if streamed else io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for i in range(seconds * fps):
            frame = np.zeros((size[1], size[0], 3), np.uint8)
            frame[:] = COLOURS[i // fps % len(COLOURS)]
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return bytes(buf.data) if streamed else buf.getvalue()


def colour_of(image: Image.Image) -> tuple[int, int, int]:
    """The nearest of COLOURS to the image's middle pixel (a YUV round trip is not exact)."""
    pixel = np.array(image.getpixel((image.width // 2, image.height // 2)))
    return min(COLOURS, key=lambda c: np.abs(pixel - c).sum())


@pytest.mark.parametrize("fmt,codec", [("mp4", "mpeg4"), ("mp4", "libx264"), ("webm", "libvpx")])
def test_video_sampled_at_2_fps(fmt, codec):
    av = pytest.importorskip("av")
    data = make_video(av, fmt, codec)
    url = data_url(data, f"video/{fmt}")
    video = decode_video(fetch_bytes(url, DATA_ONLY, LIMITS, VIDEO), LIMITS, VIDEO)
    assert video.timestamps == pytest.approx([0, 0.5, 1, 1.5, 2, 2.5], abs=1e-3)
    assert [colour_of(f) for f in video.frames] == [c for c in COLOURS[:3] for _ in range(2)]
    assert all(f.mode == "RGB" and f.size == (64, 48) for f in video.frames)
    assert video.fps == pytest.approx(10) and video.duration == pytest.approx(3, abs=1e-3)


def test_video_sampling_keeps_its_span_and_takes_each_frame_once():
    av = pytest.importorskip("av")
    data = make_video(av)
    halved = decode_video(data, FetchLimits(max_video_frames=4), VIDEO)  # 6 ticks at 2 fps: 3 at 1 fps
    assert halved.timestamps == pytest.approx([0, 1, 2], abs=1e-3)
    assert [colour_of(f) for f in halved.frames] == COLOURS[:3]
    slow = decode_video(make_video(av, seconds=4, fps=1), LIMITS, VIDEO)  # 1 fps source, 2 fps ticks
    assert slow.timestamps == pytest.approx([0, 1, 2, 3], abs=1e-3)
    assert [colour_of(f) for f in slow.frames] == COLOURS


def test_video_refusals():
    av = pytest.importorskip("av")
    data = make_video(av)
    message = refused("media_too_large", decode_video, data, FetchLimits(max_video_seconds=2), VIDEO)
    assert VIDEO in message and "3 s long" in message and "at most 2 s" in message
    streamed = make_video(av, "webm", "libvpx", streamed=True)  # its length shows only while decoding
    assert av.open(io.BytesIO(streamed)).duration is None
    message = refused("media_too_large", decode_video, streamed, FetchLimits(max_video_seconds=2), VIDEO)
    assert "at least 2.1 s long" in message and "at most 2 s" in message
    assert len(decode_video(streamed, LIMITS, VIDEO).frames) == 6
    message = refused("media_too_large", decode_video, data, FetchLimits(max_pixels=1000), VIDEO)
    assert VIDEO in message and "64x48" in message and "1,000 pixels" in message
    message = refused("media_corrupt", decode_video, data[:len(data) // 2], LIMITS, VIDEO)
    assert VIDEO in message and "damaged" in message
    for other in (encode(quadrants(), "PNG"), b"not a video", b""):
        message = refused("media_unsupported_format", decode_video, other, LIMITS, VIDEO)
        assert "MP4, MOV, WebM, MKV or AVI" in message
    buf = io.BytesIO()  # an MP4 of sound only
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        silence = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        silence.sample_rate = 8000
        container.mux(stream.encode(silence))
        container.mux(stream.encode())
    assert "no video track" in refused("media_unsupported_format", decode_video, buf.getvalue(), LIMITS, VIDEO)


def test_video_without_pyav(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    message = refused("media_decoder_missing", decode_video, b"\x00\x00\x00\x18ftypmp42", LIMITS, VIDEO)
    assert VIDEO in message and "pip install 'flagdeploy[vision]'" in message
