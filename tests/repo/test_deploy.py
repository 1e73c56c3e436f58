"""The compose file's commands are real rlmesh commands with valid configurations, and what it
mounts and builds exists (`make compose-test`, tests/e2e/test_compose.py, runs the stack for real)."""

import re

import yaml

from rlmesh.cli import service_entry_points
from rlmesh.config import load_config
from rlmesh.job.demo import build_parser as demo_parser
from tests.support.repo import REPO

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVED = {"reward", "reference", "rollout", "learner", "control"}


def expand(arg: str) -> str:
    # ${VAR:-default} as compose expands it with VAR unset.
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def rlmesh_services() -> dict[str, dict]:
    return {n: s for n, s in COMPOSE["services"].items() if s.get("image", "").startswith("rlmesh:")}


def test_every_served_service_is_a_valid_rlmesh_serve():
    known = set(service_entry_points())
    services = rlmesh_services()
    assert set(services) == SERVED | {"prepare", "export"}
    for name in SERVED:
        command = [expand(a) for a in services[name]["command"]]
        assert command[:2] == ["serve", name] and name in known
        config = command[command.index("-c") + 1]
        assert (REPO / config).exists()
        cfg = load_config(REPO / config, command[command.index("-c") + 2 :])
        assert cfg.rlmesh.run_id == "compose" and cfg.rlmesh.redis_url == "redis://rlmesh@redis:6379/0"
        assert getattr(cfg.rlmesh, name).host == "0.0.0.0"


def test_the_stack_refuses_to_start_without_its_two_secrets():
    """``${VAR:?message}``: docker-compose itself refuses to start with the variable unset or empty."""
    required = re.compile(r"^\$\{(RLMESH_AUTH_TOKEN|RLMESH_REDIS_PASSWORD):\?[^}]+\}$")
    for name, svc in rlmesh_services().items():
        env = svc["environment"]
        for var in ("RLMESH_AUTH_TOKEN", "RLMESH_REDIS_PASSWORD"):
            assert required.match(env[var]) and var in env[var], (name, var, env.get(var))
    redis = COMPOSE["services"]["redis"]["environment"]
    assert required.match(redis["RLMESH_REDIS_PASSWORD"])
    # Only the Redis URL's user is in argv: the password reaches the services in their environment.
    for name in SERVED:
        command = " ".join(rlmesh_services()[name]["command"])
        assert "redis://rlmesh@redis:6379/0" in command and ":@" not in command
    assert "/.env" in (REPO / ".gitignore").read_text().split()


def test_the_one_shot_services_prepare_what_the_others_read():
    services = rlmesh_services()
    prepare = [expand(a) for a in services["prepare"]["command"]]
    args = demo_parser().parse_args(prepare[1:])
    assert prepare[0] == "demo" and args.prepare_only
    # The learner's and the replicas' model and data are what `demo --prepare-only` links.
    learner = [expand(a) for a in services["learner"]["command"]]
    assert f"actor_rollout_ref.model.path={args.workdir}/model" in learner
    assert f"data.train_files={args.workdir}/data/train.parquet" in learner
    checkpoints = next(a.split("=", 1)[1] for a in learner if a.startswith("trainer.default_local_dir="))
    export = [expand(a) for a in services["export"]["command"]]
    assert export[export.index("--checkpoint") + 1] == checkpoints
    # Run after the learner, not by `up`: a dependency on its completion would hold `up -d` for the run.
    assert services["export"]["profiles"] == ["export"] and "depends_on" not in services["export"]


def test_built_and_mounted_files_exist():
    for name, svc in COMPOSE["services"].items():
        build = svc.get("build") or {}
        if build:
            assert (REPO / build["dockerfile"]).is_file(), name
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name} mounts {source}, which does not exist"
    assert "redis-data:/data" in COMPOSE["services"]["redis"]["volumes"]
    assert "appendonly" in (REPO / "deploy" / "redis.Dockerfile").read_text()


def test_prometheus_finds_the_replicas_by_dns():
    prom = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    rollout = [j for j in prom["scrape_configs"] if j.get("dns_sd_configs")]
    assert {sd["names"][0] for j in rollout for sd in j["dns_sd_configs"]} == {"rollout"}
    static = [t for j in prom["scrape_configs"] for sc in j.get("static_configs", []) for t in sc["targets"]]
    assert {t.split(":")[0] for t in static} == {"learner", "reward", "reference", "control"}
    # The rule file Prometheus loads is the one the compose file mounts.
    mounts = dict(
        v.split(":")[:2] for v in COMPOSE["services"]["prometheus"]["volumes"] if v.startswith("./")
    )
    assert mounts["./deploy/alerts.yml"] in prom["rule_files"]


def test_the_gpu_recipe_compose_override_names_valid_configs():
    override = yaml.safe_load((REPO / "examples" / "gpu_qwen2.5-0.5b_gsm8k.compose.yml").read_text())
    services = override["services"]
    assert set(services) <= set(COMPOSE["services"]), "an override of services the compose file does not have"
    for name in SERVED:
        command = [expand(a) for a in services[name]["command"]]
        cfg = load_config(REPO / command[command.index("-c") + 1], command[command.index("-c") + 2 :])
        assert (
            cfg.rlmesh.redis_url == "redis://rlmesh@redis:6379/0"
            and getattr(cfg.rlmesh, name).host == "0.0.0.0"
        )
        assert cfg.actor_rollout_ref.rollout.name == "sglang" and cfg.rlmesh.run_id == "gsm8k"
    assert services["prepare"]["build"]["args"]["EXTRAS"] == "gpu"


def test_the_gpu_recipe_ray_script_is_a_valid_rlmesh_ray_up():
    import shlex

    from rlmesh.ray.cli import build_parser as ray_parser

    script = (REPO / "examples" / "gpu_qwen2.5-0.5b_gsm8k.ray.sh").read_text().replace("\\\n", " ")
    line = next(ln for ln in script.splitlines() if ln.startswith("exec rlmesh ray up"))
    argv = [a for a in shlex.split(line)[3:] if a != "$@"]
    args = ray_parser().parse_args(argv)
    cfg = load_config(REPO / args.config, args.overrides)
    assert cfg.rlmesh.rollout.replicas == 4 and cfg.rlmesh.learner.ranks == 4
    from rlmesh.ray.plan import plan_actors

    gpus = {p.name: p.num_gpus for p in plan_actors(cfg)}  # the reference in the learner: 8 GPUs
    assert sum(gpus.values()) == 8 and gpus["learner"] == 4


def test_the_gpu_recipe_compose_override_reserves_the_gpus_of_the_plan():
    """Each service's device_ids are what `rlmesh config show` plans for the recipe: the learner's
    ranks, the reference's GPU, and the replicas' GPUs as one pool they claim slots of."""
    from rlmesh.config.placement import plan_gpus

    override = REPO / "examples" / "gpu_qwen2.5-0.5b_gsm8k.compose.yml"
    services = yaml.safe_load(override.read_text())["services"]

    def reserved(name: str) -> tuple[int, ...]:
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device, f"{name}: count gives every container the first GPUs; name device_ids"
        return tuple(int(d) for d in device["device_ids"])

    command = [expand(a) for a in services["rollout"]["command"]]
    recipe = REPO / command[command.index("-c") + 1]
    assert load_config(recipe, command[command.index("-c") + 2 :]).rlmesh.placement.claim_gpus
    plan = {p.name: p.gpus for p in plan_gpus(load_config(recipe)).placed}
    assert reserved("learner") == plan["learner"] and reserved("reference") == plan["reference"]
    pool = tuple(g for name, gpus in plan.items() if name.startswith("rollout") for g in gpus)
    assert reserved("rollout") == pool
