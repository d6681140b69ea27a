"""User configuration: one frozen :class:`Config` of nested sections, with defaults.

Sources, later ones win: built-in defaults, then a TOML or YAML file, then
environment variables ``RESIHP_<SECTION>__<FIELD>=value`` (e.g.
``RESIHP_DETECTOR__SLOW_THRESHOLD=0.3``). Values from the environment are text and are
parsed to the field's type; values from files must already have the field's type,
except that a float field accepts an int and numeric text (PyYAML reads ``1e-3`` as a
string).

Every problem raises :class:`ConfigError` naming the field path
(``detector.slow_threshold``), the bad value and where it came from (the file or the
environment variable). Unknown keys are errors, with a close-match suggestion, because
a misspelt key silently falling back to its default is the worst kind of config bug.

``runtime.secret`` is the job's shared HMAC secret: it is hidden from ``repr`` and
error messages and not written by :meth:`Config.to_toml` unless asked; an empty
secret means the launcher generates one per job.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Mapping

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "DetectorConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "ModelConfig",
    "TrainingConfig",
    "ENV_PREFIX",
    "load_config",
    "memory_estimate",
]

ENV_PREFIX = "RESIHP_"
CONFIG_PATH_ENV = "RESIHP_CONFIG"


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_MISSING: Any = _Unset()


class ConfigError(ValueError):
    """A configuration problem; ``path``, ``value`` and ``source`` say what and where."""

    def __init__(
        self,
        problem: str,
        *,
        path: str | None = None,
        value: Any = _MISSING,
        source: str | None = None,
    ) -> None:
        self.problem = problem
        self.path = path
        self.value = value
        self.source = source
        msg = problem
        if path is not None and value is not _MISSING:
            msg = f"{path} = {value!r}: {problem}"
        elif path is not None:
            msg = f"{path}: {problem}"
        super().__init__(f"{source}: {msg}" if source else msg)

    def at(self, source: str) -> ConfigError:
        """The same error, attributed to ``source`` (a file name or an env variable)."""
        return ConfigError(self.problem, path=self.path, value=self.value, source=source)


# --------------------------------------------------------------------- checks
Check = Callable[[Any], "str | None"]


def _gt(lo: float) -> Check:
    return lambda v: None if v > lo else f"must be > {lo}"


def _ge(lo: float) -> Check:
    return lambda v: None if v >= lo else f"must be >= {lo}"


def _between(lo: float, hi: float) -> Check:
    return lambda v: None if lo <= v <= hi else f"must be in [{lo}, {hi}]"


def _finite(v: float) -> str | None:
    return None if math.isfinite(v) else "must be finite"


def _pow2(v: int) -> str | None:
    return None if v > 0 and v & (v - 1) == 0 else "must be a power of two"


def _nonempty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


def _opt(default: Any, *checks: Check, secret: bool = False) -> Any:
    """A field with a default, range checks, and (for secrets) no repr."""
    return field(default=default, repr=not secret, metadata={"checks": checks, "secret": secret})


class _Section:
    """Base of every section: checks types and ranges at construction, however built."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            path = f"{self.SECTION}.{f.name}"
            shown = "***" if f.metadata.get("secret") else getattr(self, f.name)
            value = _check_type(path, hints[f.name], getattr(self, f.name), shown)
            object.__setattr__(self, f.name, value)
            for check in f.metadata.get("checks", ()):
                problem = check(value)
                if problem:
                    raise ConfigError(problem, path=path, value=shown)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _check_type(path: str, tp: Any, value: Any, shown: Any) -> Any:
    """``value`` if it has type ``tp`` (an int is accepted for a float), else ConfigError."""
    if typing.get_origin(tp) is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
        raise ConfigError(f"must be one of {_type_name(tp)}", path=path, value=shown)
    ok = (
        isinstance(value, tp) and not (tp is int and isinstance(value, bool))
        if tp is not float
        else isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    if not ok:
        raise ConfigError(
            f"expected {_type_name(tp)}, got {type(value).__name__}", path=path, value=shown
        )
    return float(value) if tp is float else value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _from_text(tp: Any, text: str) -> Any:
    """Parse environment text to ``tp``; returns the text unchanged when it does not parse
    (so the type check reports it with the field's name)."""
    s = text.strip()
    try:
        if tp is bool:
            return True if s.lower() in _TRUE else False if s.lower() in _FALSE else text
        if tp is int:
            return int(s)
        if tp is float:
            return float(s)
    except ValueError:
        return text
    return text


# --------------------------------------------------------------------- sections
@dataclass(frozen=True)
class DetectorConfig(_Section):
    """Fail-stop heartbeats and the fail-slow change-point filter (docs/design.md §3)."""

    SECTION: ClassVar[str] = "detector"

    heartbeat_interval_s: float = _opt(0.1, _gt(0), _finite)
    heartbeat_miss_limit: int = _opt(3, _ge(1))
    # A hang: progress stalls longer than factor x the typical step time, and at least
    # hang_min_timeout_s (so a short early history cannot cause a false alarm).
    hang_timeout_factor: float = _opt(10.0, _gt(1), _finite)
    hang_min_timeout_s: float = _opt(5.0, _gt(0), _finite)
    # A silent worker whose process is stopped (SIGSTOP, a debugger, a preempting host)
    # is fenced, not killed, for up to this long; it is offered back when it resumes
    # and beats steadily again (docs/detector.md "Paused workers").
    pause_max_s: float = _opt(300.0, _gt(0), _finite)
    changepoint_method: str = _opt("bocpd", _nonempty)
    changepoint_threshold: float = _opt(0.8, _between(0, 1))  # posterior probability
    changepoint_hazard: float = _opt(0.01, _between(0, 1), _gt(0))  # 1 / expected run length
    slow_threshold: float = _opt(0.25, _gt(0), _finite)  # measured > predicted x (1 + this)
    min_changepoint_gap: int = _opt(10, _ge(1))  # iterations
    warmup_iterations: int = _opt(3, _ge(1))  # fits the micro-batch cost model
    # A node agent that sends nothing this long while its connection stays open (a frozen
    # host, a silent partition) is lost with every device of its node; a dead agent's
    # closed connection is seen at once. 0: max(10 s, 2 x miss_limit x interval). On a
    # loaded host an agent starved of CPU falls silent too: size it to the host's
    # scheduling delays (docs/multihost.md, "Partition").
    agent_silence_s: float = _opt(0.0, _ge(0), _finite)

    def agent_silence(self) -> float:
        """Seconds of an agent's silence after which its node is lost (see ``agent_silence_s``)."""
        if self.agent_silence_s > 0:
            return self.agent_silence_s
        return max(10.0, 2 * self.heartbeat_miss_limit * self.heartbeat_interval_s)


@dataclass(frozen=True)
class SchedulerConfig(_Section):
    """Progressive TP -> PP -> DP adaptation (docs/design.md §4)."""

    SECTION: ClassVar[str] = "scheduler"

    delta: int = _opt(1, _ge(0))  # progress gap (micro-batches) that triggers a migration
    schedule: Literal["gpipe", "1f1b", "zbh1"] = _opt("1f1b")
    device_memory_gib: float = _opt(80.0, _gt(0), _finite)
    k_min: int = _opt(1, _pow2)  # smallest TP degree whose shard fits device memory
    # The payback rule a fail-slow re-plan must pass (docs/detector.md, "Acting on a
    # slowdown"): the gain counted over this many iterations (capped by those left)...
    payback_horizon_iterations: int = _opt(100, _ge(1))
    # ...against a reconfiguration's cost: until one is measured, the workers' own timing
    # plus one iteration, at most this many seconds (0: free until measured).
    payback_default_cost_s: float = _opt(2.0, _ge(0), _finite)


@dataclass(frozen=True)
class ParallelConfig(_Section):
    """The initial (TP, PP, DP) layout the first plan is built from."""

    SECTION: ClassVar[str] = "parallel"

    tp: int = _opt(1, _pow2)
    pp: int = _opt(2, _ge(1))
    dp: int = _opt(2, _ge(1))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class RuntimeConfig(_Section):
    """Processes and the wire: the controller's address, the job secret, the machines."""

    SECTION: ClassVar[str] = "runtime"

    controller_host: str = _opt("127.0.0.1", _nonempty, lambda v: None if not any(c.isspace() or c in "/@" for c in v)
                                else "must be a host name or address (no spaces, '/' or '@')")
    controller_port: int = _opt(29400, _between(0, 65535))  # 0 = any free port
    secret: str = _opt("", secret=True)
    nodes: int = _opt(1, _ge(1))
    devices_per_node: int = _opt(4, _ge(1))
    adapter: str = _opt("")  # "": the adapter registered as the default (resihp plugins)
    # The workers' devices and collectives (docs/gpu.md): "auto" = NCCL on cuda:<local
    # rank> when CUDA is there, else CPU and gloo; "nccl" insists on GPUs; "gloo" = CPU.
    backend: Literal["auto", "gloo", "nccl"] = _opt("auto")
    metrics_host: str = _opt("127.0.0.1", _nonempty)  # Prometheus exporter (plugin), if enabled
    metrics_port: int = _opt(0, _between(0, 65535))  # 0 = no metrics endpoint
    # Interface name (e.g. "eth0") or local address every node's workers bind their
    # collectives (gloo, NCCL) to; "" = the interface each agent reaches the controller on.
    interface: str = _opt("")
    # How long agents, workers and the job store wait for a lost controller to come
    # back (``resihp run --resume``) before ending the job's processes; 0 = they end
    # with it (docs/failover.md).
    controller_grace_s: float = _opt(60.0, _between(0.0, 86400.0), _finite)


@dataclass(frozen=True)
class ModelConfig(_Section):
    """A decoder-only transformer; the defaults are tiny so CPU demos run in seconds."""

    SECTION: ClassVar[str] = "model"

    layers: int = _opt(8, _ge(1))
    hidden: int = _opt(64, _ge(1))
    heads: int = _opt(4, _ge(1))
    vocab: int = _opt(256, _ge(2))
    ffn_hidden: int = _opt(0, _ge(0))  # 0 = 4 x hidden

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden


@dataclass(frozen=True)
class TrainingConfig(_Section):
    SECTION: ClassVar[str] = "training"

    microbatches: int = _opt(4, _ge(1))  # per replica per iteration
    token_budget: int = _opt(128, _ge(1))  # N: tokens packed into each micro-batch
    iterations: int = _opt(20, _ge(1))
    seed: int = _opt(0, _ge(0))
    dtype: Literal["float32", "float64"] = _opt("float32")
    lr: float = _opt(1e-3, _gt(0), _finite)
    # Where workers write verified checkpoints; "" = a folder of the run's working
    # directory. Across machines it must be storage every host sees.
    checkpoint_dir: str = _opt("")
    # A checkpoint after every this many iterations and after the last (0: none; a
    # failure that needs a restore then restarts from the seed), and
    # the newest complete checkpoints kept (0: all; 1 is refused because the newest
    # may be of an iteration that never committed). See docs/checkpoints.md.
    checkpoint_every: int = _opt(1, _ge(0))
    checkpoint_keep: int = _opt(3, lambda v: None if v == 0 or v >= 2 else "must be 0 (keep all) or >= 2")
    # Every this many committed iterations each rank's state is also held in a peer's
    # memory on another node; a restore after a whole stage is lost reads it, not a
    # checkpoint file (0: none; adapters declaring memory_copy). docs/checkpoints.md.
    memory_copy_every: int = _opt(0, _ge(0))


@dataclass(frozen=True)
class DataConfig(_Section):
    """What the job trains on: ``source`` names a data source (built in: ``synthetic``,
    ``text``; plugins add more through ``resihp_register_data_sources``), and every
    other key of ``[data]`` is an option of that source, which validates it when the
    job is assembled (:func:`resihp_core.data.create_source`, docs/data.md). The default
    is the synthetic long-tailed corpus."""

    SECTION: ClassVar[str] = "data"
    OPEN: ClassVar[bool] = True  # keys besides `source` are the source's options

    source: str = _opt("synthetic", _nonempty)
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, v in self.options.items():
            path = f"data.{key}"
            if not isinstance(key, str) or not key.isidentifier() or key == "options":
                raise ConfigError("not a valid option name", path=path)
            items = v if isinstance(v, list) else [v]
            if not all(isinstance(x, (str, int, float, bool)) for x in items):
                raise ConfigError("must be a string, number, boolean or a list of them", path=path, value=v)

    def section(self) -> dict[str, Any]:
        """The ``[data]`` table as written: ``{"source": ..., **options}``."""
        return {"source": self.source, **self.options}


def _open_section(values: dict[str, Any]) -> dict[str, Any]:
    """A flat ``[data]`` table as DataConfig's fields."""
    out = {"options": {k: v for k, v in values.items() if k != "source"}}
    if "source" in values:
        out["source"] = values["source"]
    return out

#: Sections whose fields belong to a plugin, not to the core (checked by their owner).
OPAQUE_SECTIONS = ("adapter",)

_SECTIONS: dict[str, type[_Section]] = {
    c.SECTION: c
    for c in (
        DetectorConfig,
        SchedulerConfig,
        ParallelConfig,
        RuntimeConfig,
        ModelConfig,
        TrainingConfig,
        DataConfig,
    )
}


@dataclass(frozen=True)
class Config:
    """The whole configuration. Build it with :func:`load_config` or :meth:`from_dict`."""

    detector: DetectorConfig = field(default_factory=DetectorConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # The adapter's own section (``[adapter]``), opaque here: the adapter named by
    # runtime.adapter validates it when the job is assembled.
    adapter: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Checks that span sections; each names the field to change."""
        m, p, r = self.model, self.parallel, self.runtime
        if m.hidden % m.heads:
            raise ConfigError(f"must divide model.hidden = {m.hidden}", path="model.heads", value=m.heads)
        if m.heads % p.tp:
            raise ConfigError(f"must divide model.heads = {m.heads}", path="parallel.tp", value=p.tp)
        if p.pp > m.layers:
            raise ConfigError(
                f"more stages than model.layers = {m.layers}", path="parallel.pp", value=p.pp
            )
        devices = r.nodes * r.devices_per_node
        if p.world_size > devices:
            raise ConfigError(
                f"tp x pp x dp = {p.world_size} devices, but runtime.nodes x "
                f"runtime.devices_per_node = {devices}",
                path="parallel.dp",
                value=p.dp,
            )
        if p.world_size < devices:
            raise ConfigError(
                f"tp x pp x dp = {p.world_size} devices, but runtime.nodes x runtime.devices_per_node "
                f"= {devices}: {devices - p.world_size} device(s) would never be used",
                path="parallel.dp",
                value=p.dp,
            )
        if self.scheduler.k_min > p.tp:
            raise ConfigError(f"must be <= parallel.tp = {p.tp}", path="scheduler.k_min", value=self.scheduler.k_min)
        need = memory_estimate(self)
        budget = self.scheduler.device_memory_gib * 2**30
        if need["total"] > budget:
            raise ConfigError(
                f"the model cannot fit: about {need['total'] / 2**30:.3g} GiB per device (parameters "
                f"{need['parameters'] / 2**30:.3g}, gradients and optimizer state "
                f"{need['optimizer'] / 2**30:.3g}, activations {need['activations'] / 2**30:.3g}) but "
                f"scheduler.device_memory_gib = {self.scheduler.device_memory_gib:g}; make model.hidden, "
                f"model.layers, model.vocab or training.token_budget smaller, or parallel.tp / parallel.pp larger",
                path="model.hidden", value=m.hidden,
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> Config:
        """Build from nested mappings ``{section: {field: value}}``; absent keys keep defaults."""
        return _build(_as_sections(data, source), {}, source)

    def to_dict(self, *, include_secrets: bool = False) -> dict[str, dict[str, Any]]:
        out = dataclasses.asdict(self)
        out["data"] = self.data.section()  # flat, as written in a file
        if not include_secrets:
            out["runtime"].pop("secret")
        return out

    def to_toml(self, *, include_secrets: bool = False) -> str:
        """TOML text that :func:`load_config` reads back to an equal Config."""
        lines: list[str] = []
        for section, values in self.to_dict(include_secrets=include_secrets).items():
            lines.append(f"[{section}]")
            for key, v in values.items():
                lines.append(f"{key} = {_toml_value(v)}")
            lines.append("")
        return "\n".join(lines)


def memory_estimate(cfg: Config) -> dict[str, float]:
    """Bytes one device needs for the configured model and layout, an upper estimate:
    its share of the parameters (its stage's layers over TP, plus embedding and output),
    their gradients and Adam's two moments, and the activations of every micro-batch
    of the iteration in flight (GPipe's worst case), attention scores included."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    width = 8 if t.dtype == "float64" else 4
    h, ffn = m.hidden, m.ffn
    layers = -(-m.layers // p.pp)
    per_layer = 4 * h * h + 3 * h * ffn + 2 * h
    params = (layers * per_layer + (2 if p.pp == 1 else 1) * m.vocab * h) / p.tp
    tokens = t.microbatches * t.token_budget
    # ~ a dozen hidden-sized tensors and the FFN's inner ones per token and layer, plus
    # the attention scores (token_budget^2 per head and micro-batch).
    acts = layers * (tokens * (12 * h + 3 * ffn) + t.microbatches * m.heads * t.token_budget**2) / p.tp
    out = {"parameters": params * width, "optimizer": 3 * params * width, "activations": acts * width}
    out["total"] = sum(out.values())
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, int):
        return str(v)
    return json.dumps(v)  # a JSON string literal is a valid TOML basic string


# --------------------------------------------------------------------- loading
_Raw = dict[str, dict[str, Any]]


def _suggest(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _as_sections(data: Any, source: str) -> _Raw:
    """Check the shape ``{section: {field: value}}`` and that every key is known."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"top level must be a table/mapping, got {type(data).__name__}", source=source)
    out: _Raw = {}
    for section, values in data.items():
        if section in OPAQUE_SECTIONS:
            if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
                raise ConfigError("must be a table/mapping of named settings", path=section, source=source)
            out[section] = dict(values)
            continue
        cls = _SECTIONS.get(section) if isinstance(section, str) else None
        if cls is None:
            raise ConfigError(
                f"unknown section{_suggest(str(section), _SECTIONS)}", path=str(section), source=source
            )
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"must be a table/mapping of settings, got {type(values).__name__}",
                path=section,
                source=source,
            )
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        for key in values:
            if key not in names and not getattr(cls, "OPEN", False):
                raise ConfigError(
                    f"unknown key{_suggest(str(key), names)}", path=f"{section}.{key}", source=source
                )
        out[section] = dict(values)
    return out


def _build(raw: _Raw, origins: Mapping[str, str], default_source: str) -> Config:
    """Construct the Config; an error is attributed to where its field's value came from."""

    def blame(err: ConfigError) -> ConfigError:
        return err.at(origins.get(err.path or "", default_source))

    sections: dict[str, _Section] = {}
    for name, cls in _SECTIONS.items():
        values = dict(raw.get(name, {}))
        hints = _hints(cls)
        for key, v in values.items():
            if hints.get(key) is float and isinstance(v, str):
                values[key] = _from_text(float, v)  # YAML reads 1e-3 as text
        if getattr(cls, "OPEN", False):
            values = _open_section(values)
        try:
            sections[name] = cls(**values)
        except ConfigError as err:
            raise blame(err) from None
    opaque = {name: dict(raw.get(name, {})) for name in OPAQUE_SECTIONS}
    try:
        return Config(**sections, **opaque)  # type: ignore[arg-type]
    except ConfigError as err:
        raise blame(err) from None


def _read_file(path: Path) -> Any:
    text_source = str(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror or exc}", source=text_source) from None
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            return tomllib.loads(data.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"invalid TOML: {exc}", source=text_source) from None
    if suffix in (".yaml", ".yml"):
        import yaml  # lazily: only YAML users pay for it

        try:
            loaded = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise ConfigError(f"invalid YAML: {exc}", source=text_source) from None
        return {} if loaded is None else loaded
    raise ConfigError(
        f"unsupported config file type {path.suffix!r} (use .toml, .yaml or .yml)", source=text_source
    )


def _option_from_text(text: str) -> Any:
    """A data option from the environment: JSON when it parses (numbers, true/false,
    ``["a", "b"]``), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _env_overrides(env: Mapping[str, str]) -> tuple[_Raw, dict[str, str]]:
    """``RESIHP_<SECTION>__<FIELD>`` variables as raw values, and which variable set each."""
    raw: _Raw = {}
    origins: dict[str, str] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue  # other RESIHP_* variables (RESIHP_CONFIG, ...) are not overrides
        source = f"environment variable {var}"
        section, _, key = var[len(ENV_PREFIX) :].lower().partition("__")
        if section in OPAQUE_SECTIONS:
            text = env[var]
            raw.setdefault(section, {})[key] = next(
                (v for v in (_from_text(int, text), _from_text(float, text)) if not isinstance(v, str)), text)
            origins[f"{section}.{key}"] = source
            continue
        cls = _SECTIONS.get(section)
        if cls is None:
            raise ConfigError(f"unknown section{_suggest(section, _SECTIONS)}", path=section, source=source)
        hints = _hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        if getattr(cls, "OPEN", False) and key != "source":
            raw.setdefault(section, {})[key] = _option_from_text(env[var])
            origins[f"{section}.{key}"] = source
            continue
        if key not in names:
            raise ConfigError(f"unknown key{_suggest(key, names)}", path=f"{section}.{key}", source=source)
        raw.setdefault(section, {})[key] = _from_text(hints[key], env[var])
        origins[f"{section}.{key}"] = source
    return raw, origins


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Defaults, then the file at ``path`` (``.toml``/``.yaml``/``.yml``; when None, the
    file named by ``$RESIHP_CONFIG`` if set), then ``RESIHP_<SECTION>__<FIELD>``
    overrides from ``env`` (``os.environ`` when None)."""
    env = os.environ if env is None else env
    if path is None and env.get(CONFIG_PATH_ENV):
        path = env[CONFIG_PATH_ENV]
    raw: _Raw = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        raw = _as_sections(_read_file(Path(path)), source)
    overrides, origins = _env_overrides(env)
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return _build(raw, origins, source)
