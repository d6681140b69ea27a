"""Plugin facade, hook specs, adapter contract and registries."""

from __future__ import annotations

import inspect
import logging
import re
import sys
import textwrap
import types
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from resihp_core import hookspecs
from resihp_core.adapter import (
    Adapter,
    AdapterContext,
    AdapterRegistry,
    GenerationAborted,
    IterationResult,
    Shard,
    AdapterUnavailableError,
    Capabilities,
    DuplicateNameError,
    RegistryError,
    UnknownNameError,
)
from resihp_core.hookspecs import hookimpl
from resihp_core.plan import Migration, ParallelPlan, ScheduleKind
from resihp_core.plugins import (
    ENV_BLOCK,
    ENV_DISABLE_AUTOLOAD,
    FactoryRegistry,
    PluginError,
    Plugins,
    StageRegistry,
    UnknownHookError,
    get_plugins,
    reset_plugins,
)
from resihp_core.job import JobSpec
from resihp_core.program import Forward, Program

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV_DISABLE_AUTOLOAD, raising=False)
    monkeypatch.delenv(ENV_BLOCK, raising=False)
    reset_plugins()
    yield
    reset_plugins()


MakeDist = Callable[[str, str], str]


@pytest.fixture
def make_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MakeDist:
    """Install a one-module distribution exposing entry point ``name`` in group resihp
    (a dist-info directory on sys.path, found by importlib.metadata like a real one)."""

    def make(name: str, source: str) -> str:
        module = f"fakeplug_{name}_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{module}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[resihp]\n{name} = {module}\n")
        return module

    monkeypatch.syspath_prepend(str(tmp_path))
    return make


def builtin_module(**impls: Callable[..., object]) -> types.ModuleType:
    mod = types.ModuleType(f"fake_builtin_{uuid.uuid4().hex[:8]}")
    for name, fn in impls.items():
        setattr(mod, name, fn)
    return mod


# ------------------------------------------------------------------ hook specs
def spec_functions() -> list[Callable[..., object]]:
    fns = [
        f
        for name, f in vars(hookspecs).items()
        if name.startswith("resihp_") and inspect.isfunction(f)
    ]
    assert fns
    return fns


def test_every_hook_is_a_marked_resihp_spec() -> None:
    for f in spec_functions():
        assert hasattr(f, "resihp_spec"), f"{f.__name__} is not marked with @hookspec"
        assert re.fullmatch(r"resihp_[a-z_]+", f.__name__)
        assert ":param" in (f.__doc__ or "") or not inspect.signature(f).parameters


def test_hook_families_exist() -> None:
    names = {f.__name__ for f in spec_functions()}
    assert {
        "resihp_register_adapters",
        "resihp_register_changepoint_detectors",
        "resihp_register_verification_strategies",
        "resihp_register_adaptation_stages",
        "resihp_failure_reported",
        "resihp_plan_changed",
        "resihp_iteration_finished",
    } <= names


def test_every_hook_signature_is_documented() -> None:
    docs = (ROOT / "docs" / "hooks.md").read_text()
    for f in spec_functions():
        params = ", ".join(inspect.signature(f).parameters)
        line = f"def {f.__name__}({params})"
        assert line in docs, f"docs/hooks.md lacks the signature line {line!r}"


# ------------------------------------------------------ first-party adapters
def test_first_party_adapters_are_registered_with_capabilities() -> None:
    plugins = Plugins()
    reg = plugins.adapters()
    assert {"megatron_ref", "deepspeed"} <= set(reg.names())
    sources = {i.name: i.source for i in plugins.info()}
    assert sources["megatron_ref"] == sources["deepspeed"] == "entry point"

    mega = reg.get("megatron_ref")
    assert mega.capabilities == Capabilities.all()
    assert mega.target == "resihp_adapters.megatron_ref.adapter:MegatronRefAdapter"

    ds = reg.get("deepspeed").capabilities
    assert ds.schedules == frozenset({ScheduleKind.ONE_F_ONE_B})
    assert not ds.heterogeneous_tp
    assert reg.get("deepspeed").target == "resihp_adapters.deepspeed.adapter:DeepSpeedAdapter"
    assert "resihp[deepspeed]" in reg.get("deepspeed").install_hint


def test_adapters_are_cached_until_plugins_change() -> None:
    plugins = Plugins(autoload=False, builtins=[])
    first = plugins.adapters()
    assert plugins.adapters() is first and len(first) == 0

    class Extra:
        @hookimpl
        def resihp_register_adapters(self, registry: AdapterRegistry) -> None:
            registry.register("extra", "x.y:Z", Capabilities())

    plugins.register(Extra(), name="extra")
    assert plugins.adapters().names() == ["extra"]
    plugins.unregister("extra")
    assert plugins.adapters().names() == []
    with pytest.raises(PluginError, match="no plugin named 'nope'"):
        plugins.unregister("nope")


def test_get_plugins_caches_one_instance() -> None:
    assert get_plugins() is get_plugins()
    first = get_plugins()
    reset_plugins()
    assert get_plugins() is not first


# -------------------------------------------------------------- validation
def test_unknown_hook_is_rejected_naming_plugin_and_hook() -> None:
    plugins = Plugins(autoload=False, builtins=[])

    class Typo:
        @hookimpl
        def resihp_register_adapter(self, registry: object) -> None: ...

    with pytest.raises(UnknownHookError) as err:
        plugins.register(Typo(), name="typo")
    assert err.value.plugin == "typo" and err.value.hook == "resihp_register_adapter"
    assert "did you mean 'resihp_register_adapters'" in str(err.value)
    assert "typo" not in plugins.names()


def test_unknown_hook_in_entry_point_plugin_fails_loading(make_dist: MakeDist) -> None:
    make_dist(
        "badhook",
        """
        from resihp_core.hookspecs import hookimpl

        @hookimpl
        def resihp_not_a_hook():
            pass
        """,
    )
    with pytest.raises(UnknownHookError, match="plugin 'badhook' implements unknown hook 'resihp_not_a_hook'"):
        Plugins()
    assert "badhook" not in Plugins(block=["badhook"]).names()


def test_optionalhook_may_target_unknown_hooks() -> None:
    class Future:
        @hookimpl(optionalhook=True)
        def resihp_from_a_later_version(self) -> None: ...

    plugins = Plugins(autoload=False, builtins=[])
    assert plugins.register(Future(), name="future") == "future"


def test_hook_wrappers_and_bad_arguments_are_rejected() -> None:
    plugins = Plugins(autoload=False, builtins=[])

    class Wrapper:
        @hookimpl(wrapper=True)
        def resihp_plan_changed(self, old: object, new: object, reason: str):  # type: ignore[no-untyped-def]
            return (yield)

    with pytest.raises(PluginError, match="'wrapper'.*hook wrapper"):
        plugins.register(Wrapper(), name="wrapper")

    class BadArgs:
        @hookimpl
        def resihp_plan_changed(self, plan: object) -> None: ...

    with pytest.raises(PluginError, match="plugin 'badargs'"):
        plugins.register(BadArgs(), name="badargs")


def test_builtin_implementations_must_be_trylast() -> None:
    @hookimpl
    def resihp_register_adapters(registry: AdapterRegistry) -> None: ...

    mod = builtin_module(resihp_register_adapters=resihp_register_adapters)
    with pytest.raises(PluginError, match=r"must be @hookimpl\(trylast=True\)"):
        Plugins(autoload=False, builtins=[mod])


def test_builtin_module_paths_are_imported(make_dist: MakeDist) -> None:
    module = make_dist(
        "unused",
        """
        from resihp_core.hookspecs import hookimpl

        @hookimpl(trylast=True)
        def resihp_register_changepoint_detectors(registry):
            registry.register("fixed", lambda threshold=1.0: ("fixed", threshold))
        """,
    )
    plugins = Plugins(autoload=False, builtins=[module])
    assert [(i.name, i.source) for i in plugins.info()] == [(module, "builtin")]
    assert plugins.changepoint_detectors().create("fixed", threshold=2.0) == ("fixed", 2.0)
    with pytest.raises(PluginError, match="failed to import"):
        Plugins(autoload=False, builtins=["no_such_builtin_module_xyz"])


# ---------------------------------------------------------------- switches
def test_autoload_switch_skips_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    @hookimpl(trylast=True)
    def resihp_register_adaptation_stages(registry: StageRegistry) -> None:
        registry.register("tp", lambda state: state)

    mod = builtin_module(resihp_register_adaptation_stages=resihp_register_adaptation_stages)
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    plugins = Plugins(builtins=[mod])
    assert not plugins.autoload
    assert [i.source for i in plugins.info()] == ["builtin"]
    assert len(plugins.adapters()) == 0
    assert [s.name for s in plugins.adaptation_stages().ordered()] == ["tp"]

    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "0")
    assert Plugins(builtins=[]).autoload
    assert Plugins(builtins=[], autoload=False).info() == []


def test_block_list_from_env_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_BLOCK, "deepspeed, something_else")
    plugins = Plugins(builtins=[])
    assert "deepspeed" not in plugins.adapters()
    assert "megatron_ref" in plugins.adapters()
    assert {"deepspeed", "something_else"} <= plugins.blocked

    both = Plugins(builtins=[], block=["megatron_ref"])
    assert not ({"deepspeed", "megatron_ref"} & set(both.adapters().names()))
    with pytest.raises(PluginError, match="blocked"):
        both.register(types.SimpleNamespace(), name="megatron_ref")


def test_block_list_is_the_way_past_a_broken_plugin(make_dist: MakeDist) -> None:
    make_dist("broken", "raise ImportError('needs libfoo')\n")
    with pytest.raises(PluginError, match=r"plugin 'broken' .*failed to import.*RESIHP_BLOCK_PLUGINS=broken"):
        Plugins()
    assert "megatron_ref" in Plugins(block=["broken"]).adapters()


def test_builtins_can_be_blocked_by_module_name() -> None:
    @hookimpl(trylast=True)
    def resihp_register_adapters(registry: AdapterRegistry) -> None:
        registry.register("b", "x:Y", Capabilities())

    mod = builtin_module(resihp_register_adapters=resihp_register_adapters)
    assert "b" in Plugins(autoload=False, builtins=[mod]).adapters()
    assert "b" not in Plugins(autoload=False, builtins=[mod], block=[mod.__name__]).adapters()


# ------------------------------------------------------------- precedence
def test_plugin_replaces_trylast_builtin_stage(make_dist: MakeDist) -> None:
    def builtin_tp(state: object) -> str:
        return "builtin tp"

    @hookimpl(trylast=True)
    def resihp_register_adaptation_stages(registry: StageRegistry) -> None:
        registry.register("tp", builtin_tp)
        registry.register("pp", lambda s: "builtin pp")
        registry.register("dp", lambda s: "builtin dp")

    mod = builtin_module(resihp_register_adaptation_stages=resihp_register_adaptation_stages)
    make_dist(
        "mytp",
        """
        from resihp_core.hookspecs import hookimpl

        @hookimpl
        def resihp_register_adaptation_stages(registry):
            registry.register("tp", lambda state: "plugin tp")
            registry.register("straggler_probe", lambda state: "probe", order=150)
        """,
    )
    stages = Plugins(builtins=[mod]).adaptation_stages()
    ordered = stages.ordered()
    assert [s.name for s in ordered] == ["tp", "straggler_probe", "pp", "dp"]
    assert ordered[0].run(None) == "plugin tp" and ordered[0].order == 100
    assert stages.source_of("tp") == "mytp"
    (shadow,) = stages.shadowed()
    assert (shadow.name, shadow.source, shadow.value.run) == ("tp", mod.__name__, builtin_tp)


def test_plugin_replaces_first_party_adapter(make_dist: MakeDist) -> None:
    make_dist(
        "myds",
        """
        from resihp_core.adapter import Capabilities
        from resihp_core.hookspecs import hookimpl

        @hookimpl
        def resihp_register_adapters(registry):
            registry.register("deepspeed", "myds.adapter:Better", Capabilities())
        """,
    )
    reg = Plugins(builtins=[]).adapters()
    assert reg.get("deepspeed").target == "myds.adapter:Better"
    assert reg.source_of("deepspeed") == "myds"
    assert [(r.name, r.source) for r in reg.shadowed()] == [("deepspeed", "deepspeed")]


def test_two_plugins_claiming_one_name_is_an_error() -> None:
    def claimant() -> object:
        class P:
            @hookimpl
            def resihp_register_verification_strategies(self, registry: FactoryRegistry) -> None:
                registry.register("bisect", lambda: None)

        return P()

    plugins = Plugins(autoload=False, builtins=[])
    plugins.register(claimant(), name="first")
    plugins.register(claimant(), name="second")
    with pytest.raises(DuplicateNameError, match="'bisect' is registered twice.*'second'.*'first'"):
        plugins.verification_strategies()


def test_failing_registration_names_the_plugin() -> None:
    class Boom:
        @hookimpl
        def resihp_register_adapters(self, registry: AdapterRegistry) -> None:
            raise RuntimeError("kaput")

    plugins = Plugins(autoload=False, builtins=[])
    plugins.register(Boom(), name="boom")
    with pytest.raises(PluginError, match="plugin 'boom' failed in resihp_register_adapters.*kaput"):
        plugins.adapters()


# --------------------------------------------------------------- observers
def test_observers_all_run_and_a_failing_one_is_isolated(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[str, object]] = []

    class Broken:
        @hookimpl
        def resihp_failure_reported(self, report: object) -> None:
            raise RuntimeError("exporter down")

    class Recorder:
        @hookimpl
        def resihp_failure_reported(self, report: object) -> None:
            seen.append(("failure", report))

        @hookimpl
        def resihp_plan_changed(self, new: ParallelPlan, reason: str) -> None:  # a subset of args
            seen.append(("plan", (new.generation, reason)))

        @hookimpl
        def resihp_iteration_finished(self, metrics: object) -> None:
            seen.append(("iteration", metrics))

    plugins = Plugins(autoload=False, builtins=[])
    plugins.register(Recorder(), name="recorder")
    plugins.register(Broken(), name="broken")  # registered last, so called first
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=1)
    with caplog.at_level(logging.ERROR, logger="resihp.plugins"):
        plugins.notify_failure("report-1")
    plugins.notify_plan_changed(None, plan.with_(generation=3), "fail-stop device 5")
    plugins.notify_iteration({"iteration": 7})
    assert seen == [
        ("failure", "report-1"),
        ("plan", (3, "fail-stop device 5")),
        ("iteration", {"iteration": 7}),
    ]
    assert "'broken' failed in resihp_failure_reported" in caplog.text


# -------------------------------------------------------------- registries
def test_registry_errors_are_clear() -> None:
    reg = AdapterRegistry()
    reg.register("a", "m:A", Capabilities())
    reg.register("b", "m:B", Capabilities())
    with pytest.raises(UnknownNameError, match=r"unknown adapter 'c' \(known: a, b\)"):
        reg.get("c")
    with pytest.raises(UnknownNameError, match="none registered"):
        FactoryRegistry("change-point detector").get("cusum")
    with pytest.raises(DuplicateNameError, match="'a' is registered twice"):
        reg.register("a", "m:A2", Capabilities())
    with pytest.raises(RegistryError, match="must be letters"):
        reg.register("has space", "m:A", Capabilities())
    with pytest.raises(RegistryError, match="must be a Capabilities"):
        reg.register("c", "m:C", {"tp_resize": True})  # type: ignore[arg-type]
    assert [s.name for s in reg.list()] == ["a", "b"]
    with pytest.raises(RegistryError, match="give order="):
        StageRegistry().register("new_stage", lambda s: s)


def test_adapter_targets_load_lazily_with_clear_errors() -> None:
    reg = AdapterRegistry()
    reg.register("ghost", "resihp_no_such_framework_xyz.adapter:Ghost", Capabilities(),
                 install_hint="pip install ghost-framework")
    reg.register("badpath", "no_colon_here", Capabilities())
    reg.register("notadapter", "collections:OrderedDict", Capabilities())
    reg.register("noattr", "collections:NoSuchThing", Capabilities())
    assert "resihp_no_such_framework_xyz" not in sys.modules
    with pytest.raises(AdapterUnavailableError, match="install it with: pip install ghost-framework"):
        reg.create("ghost")
    # the framework is there but the adapter module is not: no misleading install hint
    reg.register("unwritten", "resihp_core.no_such_adapter:Adapter", Capabilities(), install_hint="pip install x")
    with pytest.raises(AdapterUnavailableError, match="does not contain it"):
        reg.create("unwritten")
    with pytest.raises(RegistryError, match="must look like 'module:Class'"):
        reg.create("badpath")
    with pytest.raises(RegistryError, match="not a resihp_core.adapter.Adapter"):
        reg.create("notadapter")
    with pytest.raises(RegistryError, match="has no attribute 'NoSuchThing'"):
        reg.create("noattr")


class TinyAdapter(Adapter):
    """Records the lifecycle calls the worker makes (no framework behind it)."""

    name = "tiny"
    capabilities = Capabilities(schedules=frozenset({"gpipe"}))

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.calls: list[str] = []
        self.plan: ParallelPlan | None = None

    @property
    def where(self):
        return self.plan.location(self.ctx.device) if self.plan else None

    def rebuild_communicators(self, plan, generation, devices) -> None:
        self.calls.append(f"rebuild {generation} {devices}")

    def start_fresh(self, plan) -> None:
        self.plan = plan
        self.calls.append("fresh")

    def move_state(self, old_plan, new_plan, devices) -> int:
        self.calls.append("move")
        return 0

    def run_iteration(self, program: Program, iteration: int) -> IterationResult:
        for k, _ in enumerate(program.ops):
            self.ctx.step(iteration, k)
        self.calls.append(f"run {iteration} {len(program.ops)}")
        return IterationResult(iteration)

    def snapshot(self) -> None:
        self.calls.append("snapshot")

    def rollback(self) -> None:
        self.calls.append("rollback")

    def release(self) -> None:
        self.calls.append("release")

    def held_state(self) -> dict[str, Shard]:
        return {}


def _ctx(device: int = 3) -> AdapterContext:
    return AdapterContext(device=device, job=JobSpec(adapter="tiny"), store=None, faults=None)


def test_adapter_contract_and_create() -> None:
    with pytest.raises(TypeError):
        Adapter(_ctx())  # type: ignore[abstract]

    class Half(Adapter):
        name = "half"
        capabilities = Capabilities()

        def rebuild_communicators(self, plan, generation, devices) -> None: ...

    with pytest.raises(TypeError, match="run_iteration"):
        Half(_ctx())  # type: ignore[abstract]

    reg = AdapterRegistry()
    reg.register("tiny", TinyAdapter, TinyAdapter.capabilities)
    reg.register("tiny_path", f"{__name__}:TinyAdapter", TinyAdapter.capabilities)
    a = reg.create("tiny", _ctx(3))
    assert isinstance(a, TinyAdapter) and a.ctx.device == 3
    assert isinstance(reg.create("tiny_path", _ctx()), TinyAdapter)
    assert reg.get("tiny").target_path.endswith("TinyAdapter")
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=1)
    a.rebuild_communicators(plan, 1, [0])
    a.run_iteration(Program(replica=0, stage=0, generation=1, ops=()), 0)
    assert a.calls == ["rebuild 1 [0]", "run 0 0"]
    with pytest.raises(NotImplementedError, match="'tiny' does not implement checkpoints"):
        a.save_checkpoint(0)
    assert a.profile() is None
    a.ctx.superseded = lambda: True
    with pytest.raises(GenerationAborted):
        a.run_iteration(Program(replica=0, stage=0, generation=1, ops=(Forward(0, 0, 0),)), 1)
    a.close()  # the default close() ends the adapter's groups through release()
    assert a.calls[-1] == "release"


# ------------------------------------------------------------ capabilities
def test_capabilities_validate_and_normalise() -> None:
    caps = Capabilities(schedules=frozenset({"1f1b", ScheduleKind.ZB_H1}))  # type: ignore[arg-type]
    assert caps.schedules == frozenset({ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1})
    assert caps.to_dict()["schedules"] == ["1f1b", "zbh1"]
    with pytest.raises(ValueError, match="at least one"):
        Capabilities(schedules=frozenset())
    with pytest.raises(ValueError, match="known: gpipe, 1f1b, zbh1"):
        Capabilities(schedules=frozenset({"dualpipe"}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not the string"):
        Capabilities(schedules="1f1b")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        caps.tp_resize = True  # type: ignore[misc]


def test_capabilities_violations_gate_plans() -> None:
    base = ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=8, num_microbatches=2)
    hetero = base.with_(tp_groups=(((0,), (4, 5)), ((2, 3), (6, 7))), generation=1)
    migrated = base.with_(migrations=(Migration(stage=1, replica=0, mb=1, to=1),))
    repart = base.with_(layer_ranges=((0, 5), (5, 8)))
    zb = base.with_(schedule=ScheduleKind.ZB_H1)

    full = Capabilities.all()
    for plan in (base, hetero, migrated, repart, zb):
        assert full.violations(plan, base) == []

    plain = Capabilities()
    assert plain.violations(base) == []
    assert plain.violations(base, base) == []
    assert any("heterogeneous_tp" in v for v in plain.violations(hetero))
    assert any("tp_resize" in v for v in plain.violations(hetero, base))
    assert any("cross_replica_migration" in v for v in plain.violations(migrated))
    assert any("layer_repartition" in v for v in plain.violations(repart, base))
    assert plain.violations(repart) == []  # an uneven first plan is fine
    assert any("schedule zbh1" in v for v in plain.violations(zb))

    ds = Plugins(builtins=[]).adapters()
    # torch_native declares TP resize and heterogeneous TP with one replica only
    # (tp_with_dp = False, docs/torch_native.md); DeepSpeed declares neither
    assert ds.supporting(hetero, base) == ["megatron_ref"]
    one = ParallelPlan.uniform(tp=2, pp=2, dp=1, num_layers=8, num_microbatches=2)
    assert ds.supporting(one.with_(tp_groups=(((0,), (2, 3)),), generation=1), one) == ["megatron_ref", "torch_native"]
    assert set(ds.supporting(migrated, base)) >= {"deepspeed", "megatron_ref"}
