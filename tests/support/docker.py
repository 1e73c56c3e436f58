"""A Docker engine for ``make compose-test``: the daemon (started here when none answers), a Debian
base image made with debootstrap when no registry can be reached, the build-extra files (CA bundle,
local torch wheel), and docker-compose as a subprocess. docs/deploy.md#make-compose-test"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.polling import wait_until
from tests.support.repo import REPO

BASE_IMAGE = "local/debian:bookworm"
BUILD_EXTRA = REPO / "deploy" / "build-extra"
TORCH_WHEEL = re.compile(r"torch-2\.13\.0(\+cpu)?-cp311-cp311-manylinux[^/]*x86_64\.whl")


def run(argv: Sequence[str], **kw) -> subprocess.CompletedProcess[str]:
    """``argv``, its output captured; a failure raises with the command's own words."""
    p = subprocess.run(list(argv), capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def docker_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@dataclass
class Dockerd:
    """The daemon, and whether it is ours to stop."""

    process: subprocess.Popen[bytes] | None

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def ensure_dockerd(log_path: Path) -> Dockerd:
    """A daemon that answers: the running one, else ``dockerd`` started here (there is no systemd)."""
    if docker_answers():
        return Dockerd(None)
    if shutil.which("dockerd") is None:
        raise RuntimeError(
            "dockerd is not installed: `make compose-test` installs docker.io and docker-compose"
        )
    with log_path.open("ab") as log:
        process = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_until(lambda: docker_answers() or process.poll() is not None, 120, "dockerd to answer `docker info`")
    if process.poll() is not None:
        raise RuntimeError(f"dockerd exited {process.returncode}; its log: {log_path}")
    return Dockerd(process)


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def image_size_mb(name: str) -> float:
    return int(run(["docker", "image", "inspect", "-f", "{{.Size}}", name]).stdout.strip()) / 1e6


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 ``URIs:`` or a ``deb`` line)."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        text = path.read_text() if path.is_file() else ""
        for uri in re.findall(r"^URIs:\s*(\S+)|^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M):
            found = next(u for u in uri if u)
            if found.rstrip("/").endswith("/debian"):
                return found
    return "http://deb.debian.org/debian"


def ensure_base_image(name: str = BASE_IMAGE) -> str:
    """A Debian bookworm image: ``name`` if it exists, else made from Debian's packages with
    debootstrap (no image registry is reachable here, so ``FROM debian`` cannot be pulled)."""
    if image_exists(name):
        return name
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed: `make compose-test` installs it")
    with tempfile.TemporaryDirectory(prefix="rlmesh-rootfs-") as root:
        run(["debootstrap", "--variant=minbase", "bookworm", root, debian_mirror()])
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        run(["docker", "import", "-", name], stdin=tar.stdout)
        tar.wait()
    return name


def pip_settings() -> dict[str, str]:
    """pip's ``cert`` and ``find-links`` on this machine (its config files, then its environment)."""
    settings: dict[str, str] = {}
    for path in ("/etc/pip.conf", "/etc/xdg/pip/pip.conf", str(Path.home() / ".config/pip/pip.conf")):
        parser = configparser.ConfigParser()
        parser.read(path)
        for key in ("cert", "find-links"):
            if parser.has_option("global", key):
                settings[key] = parser.get("global", key)
    for key in ("cert", "find-links"):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            settings[key] = env
    return settings


def fill_build_extra(dest: Path = BUILD_EXTRA) -> list[str]:
    """Copies the CA bundle pip trusts and the local CPU torch wheel into deploy/build-extra/
    (git-ignored), so the image build needs neither a new certificate nor GBs of CUDA wheels."""
    settings = pip_settings()
    copied = []
    cert = Path(settings.get("cert") or "/etc/ssl/certs/ca-certificates.crt")
    if cert.is_file():
        shutil.copyfile(cert, dest / "ca-certificates.crt")
        copied.append(cert.name)
    for folder in settings.get("find-links", "").split():
        folder_path = Path(folder.removeprefix("file://"))
        wheels = (
            [p for p in folder_path.glob("torch-*.whl") if TORCH_WHEEL.fullmatch(p.name)]
            if folder_path.is_dir()
            else []
        )
        if wheels:
            (dest / "wheels").mkdir(exist_ok=True)
            target = dest / "wheels" / wheels[0].name
            if not target.exists():
                shutil.copyfile(wheels[0], target)
            copied.append(wheels[0].name)
            break
    return copied


@dataclass
class Compose:
    """``docker-compose -p PROJECT`` in the repository with an environment of its own."""

    project: str
    env: dict[str, str] = field(default_factory=dict)

    def __call__(
        self, *args: str, check: bool = True, timeout: float | None = None, stream: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Output captured, or with ``stream`` printed as it comes (a build's progress)."""
        argv = ["docker-compose", "-p", self.project, *args]
        env = {**os.environ, **self.env}
        if stream:
            p = subprocess.run(argv, cwd=REPO, env=env, text=True, timeout=timeout)
            if check and p.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} exited {p.returncode} (its output is above)")
            return p
        if check:
            return run(argv, cwd=REPO, env=env, timeout=timeout)
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    def containers(self, service: str) -> list[str]:
        """Ids of the service's containers, running or not, oldest first."""
        ids = self("ps", "-a", "-q", service).stdout.split()
        created = {i: inspect(i)["Created"] for i in ids}
        return sorted(ids, key=created.__getitem__)

    def logs(self, *services: str) -> str:
        return self("logs", "--no-color", *services, check=False).stdout


def inspect(container: str) -> dict:
    return json.loads(run(["docker", "inspect", container]).stdout)[0]


def kill_service_process(container: str) -> int:
    """``kill -9`` of the service a container runs (the child of its init, ``init: true``), from
    the host: a death, which its restart policy answers (``docker kill`` counts as a stop by hand
    and is not restarted). Returns the host pid it killed."""
    init = int(inspect(container)["State"]["Pid"])
    children = [
        int(p)
        for task in Path(f"/proc/{init}/task").iterdir()
        for p in (task / "children").read_text().split()
    ]
    assert len(children) == 1, f"{container}: its init has children {children}, not the one service"
    os.kill(children[0], signal.SIGKILL)
    return children[0]


def container_ip(container: str) -> str:
    networks = inspect(container)["NetworkSettings"]["Networks"]
    return next(n["IPAddress"] for n in networks.values() if n["IPAddress"])


def container_state(container: str) -> dict:
    return inspect(container)["State"]
