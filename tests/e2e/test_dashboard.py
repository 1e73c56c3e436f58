"""The dashboard in a real headless Chromium against a real ``rlmesh train`` job with a token: the
page asks for the token, its plots fill with the run's data (each chart's ``data-points``, read
back from the page), a bad value in the hyper-parameter form shows the plane's message naming the
field, a good one reaches the learner (its status, the audit log, and the step that trains with
it), and a screenshot of the page is kept (``docs/dashboard.png`` too with
``RLMESH_UPDATE_SCREENSHOT=1``)."""

from __future__ import annotations

import json
import os
import shutil
import signal

import httpx
import pytest

from tests.support.browser import Browser, chromium_path
from tests.support.jobs import Job, make_files, overrides, step_line
from tests.support.polling import wait_until
from tests.support.repo import CPU_DEMO, REPO

# Tiny steps (a fraction of a second each): the run is paused while the browser works and stopped
# once the page has plotted enough of it, long before its last step.
STEPS = 500
SHOWN = 30  # steps the screenshot shows
TOKEN = "dashboard-test-token"
LR = 1.25e-4  # constant schedule: hparams/actor_lr and actor/lr show it as it is
# Charts the demo's run always feeds; the others (entropy, KL loss) only when the run logs them.
ALWAYS = ("reward", "kl", "kl_coef", "grad_norm", "validation", "step_time", "tokens", "queues")


def points(browser: Browser) -> dict[str, int]:
    return browser.js(
        "Object.fromEntries([...document.querySelectorAll('[data-chart]')]"
        ".map(c => [c.dataset.chart, Number(c.dataset.points)]))"
    )


@pytest.mark.timeout(600)
def test_the_dashboard_shows_a_running_job_and_changes_its_hyperparameters(tmp_path):
    chromium_path()  # before the job: without a browser this test fails at once, saying why
    files = make_files(tmp_path / "files")
    argv = [
        "-c",
        str(CPU_DEMO),
        *overrides(files, tmp_path / "run", STEPS),
        "rlmesh.rollout.replicas=2",  # one is drained from the page at the end
        f"rlmesh.auth_token={TOKEN}",
        "trainer.val_before_train=true",
        "trainer.test_freq=10",
        "trainer.save_freq=100",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
        "actor_rollout_ref.actor.optim.warmup_ratio=0",
    ]
    job = Job.start(argv)
    browser = None
    try:
        url = job.wait_for(r"control plane: (http://\S+)/docs", 300)[1]
        api = httpx.Client(
            base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120
        )
        job.wait_for(step_line(1, STEPS), 300)
        # Held at a step boundary while the browser works, so the run cannot end under it.
        r = api.post("/run/pause")
        assert r.status_code == 200 and r.json()["paused"] is True, f"{r.text}\n{job.tail()}"
        wait_until(lambda: api.get("/run/status").json()["phase"] == "paused", 120, "the pause", every_s=0.5)
        held = api.get("/run/status").json()["step"]

        browser = Browser(tmp_path / "chromium")
        browser.goto(f"{url}/?poll_ms=1000")  # leads to /dashboard/
        browser.wait_js("!document.querySelector('#token-form').hidden", 60, "the page to ask for the token")
        browser.js(f"document.querySelector('#token').value = {json.dumps(TOKEN)}")
        browser.js("document.querySelector('#token-form').requestSubmit()")

        # The plots hold the run's data: its steps so far, the validation before training, live readings.
        browser.wait_js(
            "[...document.querySelectorAll('[data-chart]')].filter(c => c.dataset.points > 0).length >= 8",
            120,
            "the charts to fill",
        )
        got = points(browser)
        run_line = browser.js("document.querySelector('#run').textContent")
        assert "paused from the control plane (rlmesh ctl pause)" in run_line, run_line
        assert "paused (paused" not in run_line, run_line
        assert browser.js("getComputedStyle(document.querySelector('#token-form')).display") == "none"
        assert browser.js("document.querySelector('#alerts-card').dataset.firing") is not None
        assert all(got[c] > 0 for c in ALWAYS), got
        assert got["reward"] >= held and got["validation"] >= 1, got
        table = browser.js("document.querySelector('#replicas tbody').textContent")
        assert table.count("rollout-0") == 1 and table.count("rollout-1") == 1 and table.count("SERVING") == 2
        assert (
            browser.js("document.querySelector('button[data-replica=\"rollout-0\"]').textContent") == "drain"
        )

        # A value out of range: the plane's message names the field, nothing changes.
        browser.wait_js("!!document.querySelector('#hparams input[name=actor_lr]')", 30, "the form")
        browser.js("document.querySelector('#hparams input[name=clip_ratio]').value = '5'")
        browser.js("document.querySelector('#hparams').requestSubmit()")
        error = browser.wait_js(
            "document.querySelector('#hparams-msg.error')?.textContent", 60, "the form's error"
        )
        assert "clip_ratio" in error, error

        # A good one, through the form.
        browser.js("document.querySelector('#hparams input[name=clip_ratio]').value = ''")
        browser.js(f"document.querySelector('#hparams input[name=actor_lr]').value = '{LR}'")
        browser.js("document.querySelector('#hparams').requestSubmit()")
        done = browser.wait_js("document.querySelector('#hparams-msg.ok')?.textContent", 60, "the change")
        applies = int(done.split("applies from step ")[1].split(":")[0])
        assert applies == held + 1, done

        # It reached the learner (its status answers the value in force) and the audit log.
        assert api.get("/hyperparams").json()["values"]["actor_lr"] == LR
        entries = api.get("/audit", params={"action": "set_hyperparam"}).json()["entries"]
        assert [(e["target"], e["new"], e["who"].split("@")[0]) for e in entries] == [
            ("actor_lr", LR, "dashboard")
        ]

        # The learner trains with it from that step; the page shows it, and the steps that follow.
        assert api.post("/run/resume").json()["paused"] is False

        def trained_with() -> dict[int, float]:
            rows = api.get("/run/metrics", params={"keys": "hparams/actor_lr", "start": 1}).json()["rows"]
            return {
                r["step"]: r["metrics"]["hparams/actor_lr"]
                for r in rows
                if "hparams/actor_lr" in r["metrics"]
            }

        wait_until(lambda: len(trained_with()) >= SHOWN, 300, f"{SHOWN} steps in the history", every_s=0.5)
        lrs = trained_with()
        assert lrs[applies] == LR and lrs[applies - 1] != LR, lrs
        browser.wait_js(
            f"Number(document.querySelector('[data-chart=reward]').dataset.points) >= {SHOWN}",
            60,
            f"the page to plot {SHOWN} steps",
        )
        now = browser.js("document.querySelector('tr[data-hparam=actor_lr] .now').textContent")
        assert float(now) == LR, now
        assert "dashboard" in browser.js("document.querySelector('#audit tbody').textContent")

        shot = browser.screenshot(tmp_path / "dashboard.png")
        assert shot.stat().st_size > 20_000  # a page of plots, not a blank one
        if os.environ.get("RLMESH_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(shot, REPO / "docs" / "dashboard.png")

        # Drain from the table: a click arms the button, a second drains; the other replica goes on.
        drain = "document.querySelector('button[data-replica=\"rollout-1\"]')"
        browser.js(f"{drain}.click()")
        assert browser.js(f"{drain}.textContent") == "confirm drain"
        browser.js(f"{drain}.click()")
        browser.wait_js(
            "/^rollout-1: (?!draining)/.test(document.querySelector('#replicas-msg').textContent)",
            120,
            "the drain",
        )
        assert [r["replica_id"] for r in api.get("/replicas").json()["replicas"]] == ["rollout-0"]
        [drained] = api.get("/audit", params={"action": "drain"}).json()["entries"]
        assert drained["target"] == "rollout-1" and drained["who"].startswith("dashboard@"), drained

        # A graceful stop ends the job (exit 0) long before its last step.
        assert api.post("/run/stop", json={"checkpoint": False}).status_code == 200
        assert job.finish(300) == 0, job.tail()
    finally:
        if browser is not None:
            browser.close()
        if job.proc.poll() is None:  # a failure above: stop the job without hiding it
            job.proc.send_signal(signal.SIGINT)
            job.proc.wait(timeout=120)
