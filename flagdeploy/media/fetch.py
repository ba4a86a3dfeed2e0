"""A request's media URL to checked bytes, and bytes to RGB pixels, each step bounded.

Every byte here comes from a client, so each step refuses before it spends: a URL the media policy
does not take is never fetched, a body is abandoned as soon as it is too large, an image's pixel
count is read from its header before its pixels are decoded, and a video's length before its frames.
Each refusal is a `MediaError` whose message names the item, the limit and what the client can do.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

import httpx
from PIL import Image, ImageOps

from flagdeploy.errors import FlagdeployError
from flagdeploy.media_policy import MediaPolicy


@dataclass(frozen=True)
class FetchLimits:
    """What one medium may cost the server.

    `timeout_s`: an http(s) fetch, so that a slow or stalled host cannot hold a worker: no wait
    (connecting, the answer, the next bytes) is longer, and a body still arriving after it is abandoned.
    `max_bytes`: one medium's encoded size, inline or fetched, so that memory is bounded before decoding.
    `max_pixels`: width x height of an image or of one video frame, read from the header before
    decoding: a small compressed file can expand to gigabytes (a decompression bomb).
    `max_video_seconds`: a video's length, which bounds the decoding time.
    `video_fps`: frames taken per second of video (GLM-5.3-Flash samples video at 2 FPS).
    `max_video_frames`: frames taken from one video; a longer video is sampled at half the rate (or a
    quarter, ...) so that its frames still span all of it.
    """

    timeout_s: float = 10.0
    max_bytes: int = 20 * 2**20
    max_pixels: int = 4096 * 4096
    max_video_seconds: float = 600.0
    video_fps: float = 2.0
    max_video_frames: int = 480


class MediaError(FlagdeployError, ValueError):
    """A medium a request carries that cannot be used. `code` is a short machine code
    (media_url_not_allowed, media_fetch_failed, media_too_large, media_unsupported_format,
    media_corrupt, media_decoder_missing); the server answers 400 with it and the message."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(message)


@dataclass
class VideoFrames:
    """The frames sampled from a video: RGB images, each with its time in seconds from the start;
    `fps` is the source's frame rate and `duration` its length in seconds."""

    frames: list[Image.Image]
    timestamps: list[float]
    fps: float
    duration: float


def content_hash(data: bytes) -> str:
    """The key caches hold a medium under (encoder outputs, prefix blocks): equal bytes, equal key."""
    return hashlib.sha256(data).hexdigest()


def fetch_bytes(url: str, policy: MediaPolicy, limits: FetchLimits, what: str) -> bytes:
    """The bytes of a `data:` URL, or of an http(s) URL of a host `policy` allows (the same rule the
    gateway checks with); MediaError otherwise. Blocking: call it from a worker thread."""
    text = url.strip()
    if text[:5].lower() == "data:":
        data = _data_url(text, what)
    else:
        problem = policy.url_problem(text)
        if problem is not None:
            takes = (f"data: URLs and http(s) URLs of {', '.join(policy.domains)}" if policy.domains
                     else "data: URLs only")
            raise MediaError("media_url_not_allowed",
                             f"{what} ({text[:120]}) {problem}; this server takes {takes}. Send it inline as a "
                             f"base64 data: URL (data:<type>;base64,...), or have the operator allow its host "
                             f"(--allowed-media-domains).")
        data = _http_get(text, limits, what)
    if len(data) > limits.max_bytes:
        raise _too_large(what, len(data), limits)
    return data


def _data_url(url: str, what: str) -> bytes:
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError("media_corrupt", f"{what} is a data: URL without the comma that starts its data; "
                                          f"write data:<type>;base64,<data>.")
    params = [p.strip() for p in header.split(";")]
    media_type = params[0].lower()
    if media_type and not media_type.startswith(("image/", "video/")):
        raise MediaError("media_unsupported_format",
                         f"{what} is declared as {media_type!r}; this server takes images and videos only "
                         f"(image/png, image/jpeg, image/webp, image/gif, image/bmp, video/mp4, video/webm). "
                         f"Send it with its image/ or video/ media type.")
    if params[-1].lower() != "base64":
        return unquote_to_bytes(payload)
    # Standard base64; a client may have percent-encoded it, wrapped it, or dropped its padding.
    b64 = "".join(unquote_to_bytes(payload).decode("ascii", "replace").split())
    try:
        return base64.b64decode(b64 + "=" * (-len(b64) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("media_corrupt", f"{what} is a data: URL whose data is not valid base64; encode the "
                                          f"file's bytes with standard base64 (A-Z, a-z, 0-9, +, /).") from None


def _http_get(url: str, limits: FetchLimits, what: str) -> bytes:
    deadline = time.monotonic() + limits.timeout_s
    failed = f"{what} could not be fetched from {url[:120]}"
    try:
        # identity: media are compressed already, and a gzip body could expand past max_bytes in one chunk
        with httpx.Client(timeout=limits.timeout_s, follow_redirects=False) as client, \
                client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as response:
            status = response.status_code
            if 300 <= status < 400:
                to = response.headers.get("location", "elsewhere")
                raise MediaError("media_fetch_failed",
                                 f"{failed}: its host answered {status}, a redirect to {to[:120]}, which this "
                                 f"server does not follow (a redirect could leave the allowed hosts). Send the "
                                 f"final URL, or the medium inline as a base64 data: URL.")
            if not 200 <= status < 300:
                raise MediaError("media_fetch_failed",
                                 f"{failed}: its host answered HTTP {status} {response.reason_phrase}. Check "
                                 f"that the URL is right and public, or send the medium inline as a base64 "
                                 f"data: URL.")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_bytes:
                raise _too_large(what, int(declared), limits)
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise _too_large(what, len(body), limits, at_least=True)
                if time.monotonic() > deadline:
                    raise _timed_out(failed, limits)
            return bytes(body)
    except httpx.TimeoutException:
        raise _timed_out(failed, limits) from None
    except httpx.HTTPError as exc:
        raise MediaError("media_fetch_failed",
                         f"{failed}: {str(exc) or type(exc).__name__}. Check that the URL is right and its host "
                         f"reachable from this server, or send the medium inline as a base64 data: URL.") from None


def _timed_out(failed: str, limits: FetchLimits) -> MediaError:
    return MediaError("media_fetch_failed",
                      f"{failed}: it did not arrive within {limits.timeout_s:g} s, the most this server waits "
                      f"for a medium. Send it from a faster host, or inline as a base64 data: URL.")


def _size(n: int) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"


def _too_large(what: str, size: int, limits: FetchLimits, at_least: bool = False) -> MediaError:
    return MediaError("media_too_large",
                      f"{what} is {'more than ' if at_least else ''}{_size(size)}; this server takes at most "
                      f"{_size(limits.max_bytes)} per medium. Send a smaller or more compressed file.")


# Pillow reads only these, so that no other (and less hardened) image parser sees client bytes; the
# signatures tell a damaged file of an accepted format from a file of another format.
_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_IMAGE_SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF8": "GIF", b"BM": "BMP"}


def _image_format(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in _IMAGE_SIGNATURES.items() if data.startswith(magic)), None)


def decode_image(data: bytes, limits: FetchLimits, what: str) -> Image.Image:
    """The image as RGB pixels, upright as a viewer shows it (EXIF orientation applied, as
    transformers' load_image does), transparency composited onto white (as its convert_to_rgb
    does); the first frame of an animation."""
    try:
        image = Image.open(io.BytesIO(data), formats=_IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise _too_many_pixels(f"{what} is", None, limits) from None
    except Image.UnidentifiedImageError:
        kind = _image_format(data)
        if kind is None:
            raise MediaError("media_unsupported_format",
                             f"{what} is not a PNG, JPEG, WEBP, GIF or BMP image, the formats this server "
                             f"reads. Convert it to one of them (PNG or JPEG) and send it again.") from None
        raise _corrupt(what, kind) from None
    except (OSError, SyntaxError, ValueError, EOFError):
        raise _corrupt(what, _image_format(data)) from None
    if image.width * image.height > limits.max_pixels:
        raise _too_many_pixels(f"{what} is", image.size, limits)
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
    except (OSError, SyntaxError, ValueError, EOFError):
        raise _corrupt(what, image.format) from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _too_many_pixels(lead: str, size: tuple[int, int] | None, limits: FetchLimits) -> MediaError:
    side = int(limits.max_pixels**0.5)
    dims = f"{size[0]}x{size[1]} pixels ({size[0] * size[1]:,})" if size else "more pixels than Pillow decodes"
    return MediaError("media_too_large",
                      f"{lead} {dims}; this server takes at most {limits.max_pixels:,} pixels per image or "
                      f"video frame. Send it scaled down (e.g. to {side}x{side}).")


def _corrupt(what: str, kind: str | None) -> MediaError:
    return MediaError("media_corrupt", f"{what} is a {kind or 'media'} file that is damaged or cut short and cannot "
                                       f"be decoded. Send the complete file again.")


# FFmpeg is given only these demuxers, chosen from the file's signature: probing any format would
# let playlist formats (HLS, concat) make it open further files or URLs named inside the data.
_VIDEO_FORMATS = "MP4, MOV, WebM, MKV or AVI"


def _video_demuxer(data: bytes) -> str | None:
    if data[4:8] == b"ftyp":
        return "mov"  # MP4, MOV, 3GP
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"  # WebM, MKV
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def decode_video(data: bytes, limits: FetchLimits, what: str) -> VideoFrames:
    """Frames of the video at `limits.video_fps` (for each tick, the frame nearest it; a frame
    nearest two ticks is taken once), as RGB images with their times from the video's start."""
    try:
        import av
    except ImportError:
        raise MediaError("media_decoder_missing",
                         f"{what} is a video, and video input needs PyAV, which this server lacks. Have the "
                         f"operator install it: pip install 'flagdeploy[vision]'.") from None
    demuxer = _video_demuxer(data)
    if demuxer is None:
        raise MediaError("media_unsupported_format",
                         f"{what} is not an {_VIDEO_FORMATS} video, the formats this server reads. Convert it "
                         f"(e.g. to MP4 with H.264) and send it again.")
    try:
        with av.open(io.BytesIO(data), format=demuxer, metadata_errors="ignore") as container:
            if not container.streams.video:
                if container.streams.audio:
                    raise MediaError("media_unsupported_format", f"{what} holds sound but no picture (no video "
                                                                 f"track); send a video that has one.")
                raise _corrupt(what, "video")  # e.g. an MP4 cut short before its index
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            declared = container.duration / av.time_base if container.duration else 0.0
            if declared > limits.max_video_seconds:
                raise _too_long(what, declared, limits, at_least=False)
            size = (stream.codec_context.width, stream.codec_context.height)
            if size[0] * size[1] > limits.max_pixels:
                raise _too_many_pixels(f"{what} has frames of", size, limits)
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            return _sample(container.decode(stream), fps, limits, what)
    except av.error.FFmpegError:
        raise _corrupt(what, "video") from None


def _sample(decoded: Iterable[Any], fps: float, limits: FetchLimits, what: str) -> VideoFrames:
    interval = 1 / limits.video_fps
    ticks: list[tuple[float, Any]] = []  # (time, frame) nearest each tick 0, interval, 2 * interval, ...

    def take(picked: tuple[float, Any]) -> None:
        nonlocal ticks, interval
        ticks.append(picked)
        if len(ticks) > limits.max_video_frames:  # keep every other tick: the rate halves, the span stays
            ticks, interval = ticks[::2], interval * 2

    start = last = None
    for index, frame in enumerate(decoded):
        if frame.width * frame.height > limits.max_pixels:
            raise _too_many_pixels(f"{what} has frames of", (frame.width, frame.height), limits)
        t = frame.time if frame.time is not None else index / fps if fps else None
        if t is None:
            raise _corrupt(what, "video")
        start = t if start is None else start
        t -= start
        if t > limits.max_video_seconds:
            raise _too_long(what, t, limits, at_least=True)
        if last is not None and t <= last[0]:
            continue  # a repeated timestamp
        while len(ticks) * interval <= t:
            tick = len(ticks) * interval
            take(last if last is not None and tick - last[0] <= t - tick else (t, frame))
        last = (t, frame)
    if last is None:
        raise MediaError("media_corrupt", f"{what} has no frames that decode. Send the complete video again.")
    duration = last[0] + (1 / fps if fps else 0.0)
    while len(ticks) * interval < duration - 1e-3:  # ticks within the last frame's span (to a millisecond)
        take(last)
    unique = [picked for i, picked in enumerate(ticks) if i == 0 or picked[1] is not ticks[i - 1][1]]
    return VideoFrames([f.to_image() for _, f in unique], [t for t, _ in unique], fps, duration)


def _too_long(what: str, seconds: float, limits: FetchLimits, at_least: bool) -> MediaError:
    return MediaError("media_too_large",
                      f"{what} is {'at least ' if at_least else ''}{round(seconds, 1):g} s long; this server takes "
                      f"videos of at most {limits.max_video_seconds:g} s. Send a shorter clip.")
