"""Whether UCX is in the worker process, and with which memory settings (``moeguard_ucx_info``, issue 14).

Pure functions over the text of ``/proc/self/maps`` and the environment; the caller reads both
(:func:`moeguard_runtime.memory.ucx_scan.read_maps`) and exports the result. UCX gets into an inference process as a dependency of a KV
transfer library (NIXL) or of a UCX-enabled torch/MPI build; its memory hooks and registration cache
then keep freed memory resident outside every Python and malloc counter (vLLM issue 24264).

**UCX's defaults** (what an unset variable means), from UCX's own source:

* ``UCX_MEM_MMAP_HOOK_MODE``: ``bistro``. ``src/ucs/config/ucm_opts.c`` (openucx/ucx) declares
  ``MMAP_HOOK_MODE`` with the default ``UCM_DEFAULT_HOOK_MODE_STR``, which ``src/ucm/mmap/mmap.h`` defines
  as ``"bistro"`` when ``UCM_BISTRO_HOOKS`` is built (x86_64, aarch64, ppc64) and ``"reloc"`` otherwise.
  Debian's ``libucx0`` 1.13.1 carries ``bistro`` next to ``MMAP_HOOK_MODE`` in ``libucs.so.0``'s strings.
* ``UCX_RCACHE_MAX_UNRELEASED``: ``512M`` in ``src/uct/base/uct_md.c`` (openucx/ucx,
  ``uct_md_config_rcache_table``, the memory domains' registration cache; introduced by openucx/ucx
  PR #6840 "Cleanup rcache when invalidate queue and GC list are large"), also what Debian's 1.13.1
  ``libuct.so.0`` carries. NIXL PR #1210 (ai-dynamo/nixl, "config sane value for rcache unreleased
  threshold (memory leak fix)") states the default it overrides as ``inf``: the unset value is judged
  unbounded by :func:`risky` (see there).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from moeguard_core import contract

UCX_LIBRARY_PREFIXES = ("libucp", "libucs", "libuct", "libucm")
"""File-name prefixes of UCX's libraries (protocols, services, transports, memory hooks). A name must
continue with ``.`` or ``_`` after the prefix (``libucs.so.0``, ``libucs_signal.so.0``,
``libuct_ib.so.0``), or with auditwheel's ``-<8 hex digits>.so`` (the UCX a pip wheel bundles: NIXL's
``nixl_cu12.libs/libucp-b39b3ed9.so.0.0.0``), so ``libucl.so``, ``libucsomething.so`` or
``libucp-tools.so`` are not UCX."""
_WHEEL_SUFFIX = re.compile(r"-[0-9a-f]{8}\.so(\.|$)")
DEFAULT_MMAP_HOOK_MODE = "bistro"
"""UCX's default ``UCX_MEM_MMAP_HOOK_MODE`` on x86_64 (module docstring: ``src/ucs/config/ucm_opts.c``)."""
DEFAULT_RCACHE_MAX_UNRELEASED = "512M"
"""UCX's default ``UCX_RCACHE_MAX_UNRELEASED`` (module docstring: ``src/uct/base/uct_md.c``)."""
DEFAULT_PREFIX = "default:"
UNBOUNDED = ("inf", "infinity")
"""``UCX_RCACHE_MAX_UNRELEASED`` values that set no bound (UCX's memunits parser reads ``inf``; unset is
judged unbounded, :func:`risky`)."""
SCAN_INTERVAL_S = 10.0
"""Seconds between two scans of ``/proc/self/maps`` in the worker (a library may be loaded late)."""


@dataclass(frozen=True)
class UcxInfo:
    """The labels of ``moeguard_ucx_info``.

    Attributes:
        libraries: the mapped UCX libraries' file names, sorted, unique.
        mmap_hook_mode: ``UCX_MEM_MMAP_HOOK_MODE`` as set, else ``default:<UCX's default>``.
        rcache_max_unreleased: ``UCX_RCACHE_MAX_UNRELEASED`` as set, else ``default:<UCX's default>``.
    """

    libraries: tuple[str, ...]
    mmap_hook_mode: str
    rcache_max_unreleased: str

    @property
    def loaded(self) -> bool:
        return bool(self.libraries)

    def labels(self) -> dict[str, str]:
        """The metric's labels: ``loaded`` (``true``/``false``), ``libraries`` (comma-separated), the two
        settings."""
        return {"loaded": "true" if self.loaded else "false", "libraries": ",".join(self.libraries),
                "mmap_hook_mode": self.mmap_hook_mode, "rcache_max_unreleased": self.rcache_max_unreleased}


def is_ucx_library(name: str) -> bool:
    """Whether a file name is one of UCX's libraries (:data:`UCX_LIBRARY_PREFIXES`)."""
    return any(name.startswith(p) and (name[len(p):len(p) + 1] in (".", "_") or bool(_WHEEL_SUFFIX.match(name, len(p))))
               for p in UCX_LIBRARY_PREFIXES)


def mapped_libraries(maps_text: str) -> tuple[str, ...]:
    """The UCX libraries mapped in a process, from its ``/proc/<pid>/maps`` text.

    A line is ``start-end perms offset dev inode [path]``; the path may contain spaces and ends with
    `` (deleted)`` when the file was removed after it was mapped (still mapped: counted). Anonymous and
    special mappings (``[heap]``) have no file name of UCX's. Returns the file names (the loader maps the
    symlink's target, e.g. ``libucs.so.0.0.0``), sorted, unique.
    """
    names: set[str] = set()
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip().removesuffix(" (deleted)")
        name = path.rsplit("/", 1)[-1]
        if is_ucx_library(name):
            names.add(name)
    return tuple(sorted(names))


def effective_settings(env: Mapping[str, str]) -> tuple[str, str]:
    """``(mmap_hook_mode, rcache_max_unreleased)``: each variable's value when set (non-empty), else
    ``default:<UCX's default>`` (:data:`DEFAULT_MMAP_HOOK_MODE`, :data:`DEFAULT_RCACHE_MAX_UNRELEASED`)."""
    hook = env.get(contract.UCX_ENV_MMAP_HOOK_MODE, "").strip()
    rcache = env.get(contract.UCX_ENV_RCACHE_MAX_UNRELEASED, "").strip()
    return (hook or DEFAULT_PREFIX + DEFAULT_MMAP_HOOK_MODE,
            rcache or DEFAULT_PREFIX + DEFAULT_RCACHE_MAX_UNRELEASED)


def ucx_info(maps_text: str, env: Mapping[str, str]) -> UcxInfo:
    """:class:`UcxInfo` of a process from its maps text and environment."""
    return UcxInfo(mapped_libraries(maps_text), *effective_settings(env))


def risky(info: UcxInfo) -> bool:
    """Whether the process runs UCX in the configuration that keeps freed memory resident: UCX loaded,
    its mmap hooks on (not ``none``), and the registration cache's invalidation queue unbounded
    (``UCX_RCACHE_MAX_UNRELEASED`` unset, or ``inf``).

    Source: vLLM issue 24264 (host memory growing without bound under NIXL/UCX); the two cures are
    vLLM PR #32181 (``UCX_MEM_MMAP_HOOK_MODE=none``) and ai-dynamo/nixl PR #1210 / vLLM PR #32570
    (``UCX_RCACHE_MAX_UNRELEASED=1024``, "overriding default value inf"), either one sufficient. An unset
    ``UCX_RCACHE_MAX_UNRELEASED`` is judged unbounded after NIXL #1210, although ``uct_md.c``'s table says
    512M (the rcache of the UCX builds NIXL ships reads its own default): the safe side.
    """
    return risky_labels(info.loaded, info.mmap_hook_mode, info.rcache_max_unreleased)


def risky_labels(loaded: bool, mmap_hook_mode: str, rcache_max_unreleased: str) -> bool:
    """:func:`risky` over ``moeguard_ucx_info``'s label values (the operator's diagnosis reads them from
    Prometheus): ``default:`` values are UCX's defaults, an unset rcache bound is judged unbounded."""
    if not loaded or mmap_hook_mode.strip().lower().removeprefix(DEFAULT_PREFIX) == contract.UCX_SAFE_MMAP_HOOK_MODE:
        return False
    rcache = rcache_max_unreleased.strip().lower()
    return not rcache or rcache.startswith(DEFAULT_PREFIX) or rcache in UNBOUNDED

