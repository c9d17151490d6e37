"""A speech recording made locally for the Silero VAD: espeak-ng speaks each sentence, sox converts it to 16 kHz mono
16-bit and pads it with silence, sox joins the pieces. Built from pieces, so where the words and the pauses are is
known to the sample."""

from __future__ import annotations

import shutil
import subprocess
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RATE = 16000
WINDOW = 512  # Silero's chunk at 16 kHz
CONTEXT = 64  # samples of the previous chunk Silero's own wrapper puts in front of each chunk

SENTENCES = (
    "Hello there.",
    "This is a test of voice activity detection.",
    "The pauses between the sentences are silent.",
)


@dataclass
class Recording:
    """The joined recording as float32 in [-1, 1), the sample range [start, end) of each sentence's voiced part, and
    of each pause (the silence sox added before, between and after the sentences)."""

    audio: np.ndarray
    words: list[tuple[int, int]]
    pauses: list[tuple[int, int]]
    path: Path

    @property
    def seconds(self) -> float:
        return self.audio.size / RATE


def tools_missing() -> str | None:
    """Why a recording cannot be made here, or None."""
    missing = [tool for tool in ("espeak-ng", "sox") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (scripts/install_reference.sh installs them with apt-get)"
    return None


def _read(path: Path) -> np.ndarray:
    with wave.open(str(path), "rb") as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (RATE, 1, 2), path
        frames = wav.readframes(wav.getnframes())
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=60)


def record(folder: Path, sentences: tuple[str, ...] = SENTENCES, lead: float = 0.5, pause: float = 1.0) -> Recording:
    """Speaks `sentences` with `lead` seconds of silence before the first, `pause` between two and `lead` after the
    last, into `folder/speech.wav`."""
    folder.mkdir(parents=True, exist_ok=True)
    lead_samples, pause_samples = round(lead * RATE), round(pause * RATE)
    pieces: list[Path] = []
    words: list[tuple[int, int]] = []
    offset = 0
    for index, sentence in enumerate(sentences):
        raw, piece = folder / f"raw{index}.wav", folder / f"piece{index}.wav"
        _run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(raw), sentence])
        before = lead_samples if index == 0 else 0
        after = lead_samples if index == len(sentences) - 1 else pause_samples
        # rate first, so that the pad lengths are 16 kHz samples
        _run(["sox", str(raw), "-c", "1", "-b", "16", "-e", "signed-integer", str(piece),
              "rate", str(RATE), "pad", f"{before}s", f"{after}s"])
        samples = _read(piece)
        spoken = samples[before:samples.size - after]
        voiced = np.flatnonzero(np.abs(spoken) > 0.02 * np.abs(spoken).max())  # less espeak's own short lead and tail
        words.append((offset + before + int(voiced[0]), offset + before + int(voiced[-1]) + 1))
        pieces.append(piece)
        offset += samples.size
    # the silence around and between the voiced parts
    edges = [0, *(edge for word in words for edge in word), offset]
    pauses = list(zip(edges[0::2], edges[1::2], strict=True))
    joined = folder / "speech.wav"
    _run(["sox", *map(str, pieces), str(joined)])
    audio = _read(joined)
    assert audio.size == offset, (audio.size, offset)
    return Recording(audio, words, pauses, joined)


def chunks(audio: np.ndarray) -> list[np.ndarray]:
    """[1, 64 + 512] inputs as Silero's own wrapper makes them: each 512-sample chunk (the last one zero-padded) with
    the previous chunk's last 64 samples in front."""
    padded = np.pad(audio, (0, -audio.size % WINDOW)).astype(np.float32)
    context = np.zeros(CONTEXT, dtype=np.float32)
    out = []
    for start in range(0, padded.size, WINDOW):
        chunk = padded[start:start + WINDOW]
        out.append(np.concatenate([context, chunk])[np.newaxis, :])
        context = chunk[-CONTEXT:]
    return out
