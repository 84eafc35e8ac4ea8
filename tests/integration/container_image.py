"""Build and run the container image (deploy/container/Containerfile) with podman, for its tests.

Everything podman touches lives under ``.cache/container-image/`` in the
repository (ignored by git), never in the host's container configuration:

- ``base-<key>.tar``: a Debian base (debootstrap, with python3), made once per
  key (suite, variant, packages, mirror) and kept between runs.
- ``storage-<key>/``: the test's own podman storage, run and tmp directories
  and its ``containers.conf`` (``CONTAINERS_CONF``: runc, cgroupfs, no default
  ulimits, file events) and ``storage.conf`` (``CONTAINERS_STORAGE_CONF``). The
  key covers the base, the Containerfile, its helper scripts and pyproject.toml,
  so build layers are reused until one of them changes; older storages are
  removed then. A change to the sources rebuilds only the install layer.

Names are unique per run (``omni-sidecar-test-<run>``) and everything a test
created is removed by name when it is done: no other image or container is ever
touched. Containers use the host network (``--network host``): the sidecar binds
the free loopback ports the test gives it, and no bridge, NAT rule or CNI state is
created on the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
CONTAINERFILE: Final = REPO_ROOT / "deploy" / "container" / "Containerfile"
CACHE: Final = REPO_ROOT / ".cache" / "container-image"

#: The Debian base made with debootstrap: bookworm's python3 is 3.11, the project's floor.
SUITE: Final = "bookworm"
VARIANT: Final = "minbase"
PACKAGES: Final = ("python3",)
MIRROR: Final = os.environ.get("OMNI_SIDECAR_TESTS_DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: Where the test's build mounts the host's CA bundle (pip behind a TLS-inspecting proxy).
BUILD_CA: Final = "/run/build-ca.pem"

DEBOOTSTRAP_TIMEOUT: Final = 900.0
BUILD_TIMEOUT: Final = 900.0


def missing_tools() -> str | None:
    """Why podman cannot build and run images here, or None when it can."""
    if os.geteuid() != 0:
        return "the container tier runs podman as root (rootless podman needs subuids and more)"
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian packages; .ci/run installs them)"
    return None


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def base_key() -> str:
    recipe = json.dumps([SUITE, VARIANT, PACKAGES, MIRROR]).encode()
    return _digest(recipe)


def storage_key() -> str:
    helpers = sorted((REPO_ROOT / "deploy" / "container").iterdir())
    return _digest(
        base_key().encode(),
        *(p.name.encode() + b"\0" + p.read_bytes() for p in helpers if p.is_file()),
        (REPO_ROOT / "pyproject.toml").read_bytes(),
    )


@contextlib.contextmanager
def cache_lock() -> Iterator[None]:
    """One builder at a time per checkout: under pytest-xdist each worker that runs a
    test of the tier builds once, and the second waits here for the first's layers."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _record(what: str, seconds: float) -> None:
    """Append a timing to .cache/container-image/timings.log (cold and cached builds)."""
    with open(CACHE / "timings.log", "a") as log:
        log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {what} {seconds:.1f} s\n")


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    return sorted((p for p in points if p.startswith(prefix)), reverse=True)


def _remove_tree(path: Path) -> None:
    """Remove a directory this module made, after unmounting what is mounted inside it."""
    if not path.exists():
        return
    for point in _mounts_under(path):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True, timeout=60)
    shutil.rmtree(path)


def _tail(text: str, chars: int = 6000) -> str:
    return text[-chars:]


def debian_base() -> Path:
    """The cached Debian base tarball, made with debootstrap when missing."""
    tar = CACHE / f"base-{base_key()}.tar"
    if tar.exists():
        return tar
    rootfs = CACHE / f"rootfs-{os.getpid()}"
    _remove_tree(rootfs)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [
                "debootstrap", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}",
                SUITE, str(rootfs), MIRROR,
            ],
            capture_output=True, text=True, timeout=DEBOOTSTRAP_TIMEOUT, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(
                f"debootstrap {SUITE} from {MIRROR} failed ({done.returncode}); its log:\n"
                + _tail(done.stdout + done.stderr)
            )
        # Like a slim base image: no package lists or downloaded packages.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (rootfs / junk).glob("*"):
                if item.is_file():
                    item.unlink()
        for item in (rootfs / "var/cache/apt").glob("*.bin"):
            item.unlink()
        part = tar.with_suffix(".part")
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(part), "."],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        part.rename(tar)
    finally:
        _remove_tree(rootfs)
    _record(f"debootstrap {SUITE} {','.join(PACKAGES)}", time.monotonic() - started)
    return tar


@dataclass(frozen=True)
class Podman:
    """podman with this module's own configuration and storage."""

    root: Path

    @classmethod
    def for_key(cls, key: str) -> Podman:
        root = CACHE / f"storage-{key}"
        if not (root / "storage.conf").exists():
            for old in CACHE.glob("storage-*"):
                _remove_tree(old)
            for sub in ("graph", "run", "tmp"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            (root / "containers.conf").write_text(
                "# Written by tests/integration/container_image.py for its own podman runs.\n"
                "[containers]\n"
                "default_ulimits = []\n"
                "[engine]\n"
                'runtime = "runc"\n'
                'cgroup_manager = "cgroupfs"\n'
                'events_logger = "file"\n'
                f'tmp_dir = "{root / "tmp"}"\n'
            )
            (root / "storage.conf").write_text(
                "# Written by tests/integration/container_image.py for its own podman runs.\n"
                "[storage]\n"
                'driver = "overlay"\n'
                f'graphroot = "{root / "graph"}"\n'
                f'runroot = "{root / "run"}"\n'
            )
        return cls(root)

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CONTAINERS_CONF": str(self.root / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.root / "storage.conf"),
        }

    def argv(self, *args: str) -> list[str]:
        return ["podman", *args]

    def run(
        self, *args: str, timeout: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.argv(*args), env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise RuntimeError(
                f"podman {' '.join(args)} exited {done.returncode}:\n"
                + _tail(done.stdout + done.stderr)
            )
        return done

    def exists(self, image: str) -> bool:
        return self.run("image", "exists", image, check=False).returncode == 0


def _ca_bundle() -> str | None:
    for candidate in (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


@dataclass(frozen=True)
class BuiltImage:
    podman: Podman
    tag: str
    run_id: str
    build_seconds: float


def build_image(target: str = "sidecar", log_dir: Path | None = None) -> BuiltImage:
    """Build ``target`` on the cached Debian base; tagged uniquely for this run."""
    with cache_lock():
        tar = debian_base()
        podman = Podman.for_key(storage_key())
        base = f"localhost/omni-sidecar-test-base:{base_key()}"
        if not podman.exists(base):
            started = time.monotonic()
            podman.run("import", str(tar), base, timeout=600)
            _record("podman import of the base", time.monotonic() - started)
        run_id = uuid.uuid4().hex[:12]
        tag = f"localhost/omni-sidecar-test:{run_id}"
        args = [
            "build", "--format", "docker", "--runtime", "runc", "--network", "host",
            "--layers", "-f", str(CONTAINERFILE), "--target", target,
            "--build-arg", f"BASE={base}", "-t", tag,
        ]  # fmt: skip
        ca = _ca_bundle()
        if ca is not None:
            args += ["-v", f"{ca}:{BUILD_CA}:ro", "--build-arg", f"PIP_CERT={BUILD_CA}"]
        if os.environ.get("PIP_INDEX_URL"):
            args += ["--build-arg", f"PIP_INDEX_URL={os.environ['PIP_INDEX_URL']}"]
        started = time.monotonic()
        done = podman.run(*args, str(REPO_ROOT), timeout=BUILD_TIMEOUT, check=False)
        seconds = time.monotonic() - started
        if log_dir is not None:
            (log_dir / "build.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(
                f"podman build --target {target} exited {done.returncode}:\n"
                + _tail(done.stdout + done.stderr)
            )
        _record(f"podman build --target {target}", seconds)
        sizes = [
            int(podman.run("image", "inspect", "--format", "{{.Size}}", name).stdout)
            for name in (tag, base)
        ]
        with open(CACHE / "timings.log", "a") as log:
            log.write(f"  image {sizes[0] / 1e6:.0f} MB on a {sizes[1] / 1e6:.0f} MB base\n")
        return BuiltImage(podman, tag, run_id, seconds)


def remove_image(image: BuiltImage) -> None:
    """Untag and remove this run's image (the build's cached layers stay).

    Under the cache lock: an image another build has just found in its cache has
    the same ID as this one, and removing it while that build runs takes its
    build containers with it ("identifier is not a container").
    """
    with cache_lock():
        image.podman.run("rmi", "--force", image.tag, check=False, timeout=120)


#: Set for the suite by ``warm-during``: a build is already under way, start none.
WARMUP_ENV: Final = "OMNI_SIDECAR_TESTS_IMAGE_WARMUP"
#: How long the suite's end waits for a warm-up it asks to stop (it cleans up first).
WARM_STOP_TIMEOUT: Final = 60.0


class CacheWarmup:
    """The image built once in a child process while the rest of the suite runs.

    A cold build is minutes of downloads, package installs and the compile (about
    300 s of CPU on 2 cores). Started by ``make test`` before the install
    (``warm_during``), or by the suite once it is collected, it overlaps with the
    rest; the tier's own ``build_image`` then waits on the cache lock and finds
    every layer cached. It is only a head start: when it fails,
    the tier's build runs again and reports the error. The process that started
    it stops it at the suite's end if it is still running (SIGTERM: it unmounts
    what debootstrap mounted and removes its scratch tree), and after
    ``WARM_STOP_TIMEOUT`` kills what is left of its process group.
    """

    def __init__(self, proc: subprocess.Popen[bytes], marker: Path | None) -> None:
        self.proc = proc
        self.marker = marker

    @classmethod
    def start(
        cls, run_id: str | None, command: Sequence[str] | None = None, cache: Path = CACHE
    ) -> CacheWarmup | None:
        """Start it unless another process of this run (a pytest-xdist worker sharing
        ``run_id``) already has; None then. ``command`` replaces the build (tests)."""
        cache.mkdir(parents=True, exist_ok=True)
        marker = None
        if run_id is not None:
            marker = cache / f"warmup-{run_id}.started"
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return None
        if command is None:
            command = [sys.executable, "-m", "tests.integration.container_image", "warm"]
        with open(cache / "warmup.log", "wb") as log:
            proc = subprocess.Popen(
                command,
                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return cls(proc, marker)

    def wait(self, timeout: float) -> bool:
        """True once it has ended by itself, within ``timeout`` seconds."""
        return self.proc.returncode is not None or self._exited(timeout)

    def stop(self, timeout: float = WARM_STOP_TIMEOUT) -> int:
        """Its exit status; a warm-up still running is stopped first (SIGTERM, then
        after ``timeout`` seconds SIGKILL to its group).

        It is waited for without being reaped until its process group has been
        killed: until then its pid, and so its group id, cannot be anyone else's.
        """
        if self.proc.returncode is None:
            still_running = (
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
            )
            if still_running:
                os.kill(self.proc.pid, signal.SIGTERM)  # not Popen.terminate: it would reap
                self._exited(timeout)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        returncode = self.proc.wait()
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)
        return returncode

    def _exited(self, timeout: float) -> bool:
        """True once it has exited (within ``timeout`` seconds); it stays unreaped."""
        exited = threading.Event()

        def watch() -> None:
            with contextlib.suppress(ChildProcessError):  # reaped by stop() meanwhile
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
            exited.set()

        threading.Thread(target=watch, name="warmup-exit", daemon=True).start()
        return exited.wait(timeout)


def _warm() -> int:
    """Build the image into the cache and untag it: what ``CacheWarmup`` runs."""
    # SIGTERM as an exception, so that the cleanup in debian_base's finally runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    started = time.monotonic()
    remove_image(build_image("sidecar"))
    print(f"image cache warm in {time.monotonic() - started:.1f} s", flush=True)
    return 0


def warm_during(
    command: Sequence[str], warmup_command: Sequence[str] | None = None, cache: Path = CACHE
) -> int:
    """Run ``command`` with the image build started beside it; its exit status.

    ``make test`` runs the install, lint and suite this way, so a cold build
    (minutes of debootstrap and packages) starts before the install rather than
    after collection. The suite, told by ``WARMUP_ENV``, starts no build of its
    own. A build still running when ``command`` ends (the tier deselected, or a
    run stopped early) is stopped; SIGTERM is passed on to ``command``.
    ``warmup_command`` replaces the build (tests).
    """
    if warmup_command is None and missing_tools() is not None:
        return subprocess.call(command)
    warmup = CacheWarmup.start(None, warmup_command, cache=cache)
    assert warmup is not None
    try:
        with subprocess.Popen(command, env={**os.environ, WARMUP_ENV: "1"}) as proc:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
            try:
                return proc.wait()
            except KeyboardInterrupt:  # the terminal's Ctrl-C reached proc as well
                proc.wait()
                return 128 + signal.SIGINT
    finally:
        warmup.stop()


USAGE: Final = (
    f"usage: {sys.executable} -m tests.integration.container_image warm | warm-during -- COMMAND..."
)

if __name__ == "__main__":
    match sys.argv[1:]:
        case ["warm"]:
            sys.exit(_warm())
        case ["warm-during", "--", *command] if command:
            sys.exit(warm_during(command))
        case _:
            sys.exit(USAGE)
