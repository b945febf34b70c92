"""A link swapped into a bind's path between the sandbox's check and bwrap's mount is not
followed (sftctl.providers.sandbox: Binds, pin, wrap).

The sandbox resolves a job's workdir (realpath), checks it, then used to hand bwrap the PATH,
which bwrap resolved again when it mounted it: a user who replaced the checked directory with a
link in between had another user's directory bound read-write. Alice's workdir and Bob's each
hold a file ``who`` naming its owner; a hook swaps Alice's workdir for a link to Bob's at each
point between the check and the mount. Real bwrap runs each node (``wrap``'s command, or a
node the local provider launches under its guard): it reads and writes the directory that was
checked, or is refused, and Bob's directory is never written.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import wait_for
from sftctl.catalog import local_offering
from sftctl.errors import ProviderError
from sftctl.providers import sandbox, workdir_roots
from sftctl.providers.local import LocalProvider

pytestmark = pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v bwrap"], capture_output=True).returncode != 0,
                                reason="bubblewrap (bwrap) is not installed (.ci/run installs it)")


@pytest.fixture
def lab(tmp_path) -> Path:
    """``lab/alice/proj`` and ``lab/bob/proj``, each with a file ``who`` naming its owner."""
    root = tmp_path / "lab"
    for user in ("alice", "bob"):
        (root / user / "proj").mkdir(parents=True)
        (root / user / "proj" / "who").write_text(f"{user}\n")
    return root.resolve()


def _swap(path: Path, to: Path) -> Path:
    """Move the directory ``path`` aside (``proj.checked``) and put a link to ``to`` in its place;
    returns where the checked directory went."""
    aside = path.with_name(path.name + ".checked")
    path.rename(aside)
    path.symlink_to(to)
    return aside


def _run(argv: list[str], binds: sandbox.Binds) -> subprocess.CompletedProcess:
    with sandbox.wrap(argv, binds, tags={}, chdir="/") as cmd:
        return subprocess.run(cmd.argv, capture_output=True, text=True, pass_fds=cmd.pass_fds, timeout=300)


#: which of the workdir's directories the user swaps for a link: the workdir, or one above it
LEVELS = ("alice/proj", "alice")


@pytest.mark.parametrize("level", LEVELS)
def test_a_link_swapped_in_after_the_check_leaves_the_node_the_checked_directory(home, lab, level):
    alice, bob = lab / "alice" / "proj", lab / "bob" / "proj"
    binds = sandbox.Binds()
    binds.add(alice, "j-1", "workdir")
    # after the check, before bwrap mounts it
    checked = _swap(lab / level, lab / level.replace("alice", "bob")) / "proj" if level == "alice" else \
        _swap(alice, bob)
    proc = _run(["sh", "-c", f"cat {alice}/who && echo from-node > {alice}/out"], binds)
    assert (proc.stdout, proc.returncode) == ("alice\n", 0), proc.stderr
    assert (checked / "out").read_text() == "from-node\n"
    assert sorted(p.name for p in bob.iterdir()) == ["who"] and (bob / "who").read_text() == "bob\n"


@pytest.mark.parametrize("level", LEVELS)
def test_a_link_swapped_in_while_the_path_is_checked_is_refused(home, lab, monkeypatch, level):
    alice, bob = lab / "alice" / "proj", lab / "bob" / "proj"
    check_bind = sandbox.check_bind

    def check_then_swap(path, job_id, what):  # the check saw alice's directory; then it is swapped
        real = check_bind(path, job_id, what)
        _swap(lab / level, lab / level.replace("alice", "bob"))
        return real

    monkeypatch.setattr(sandbox, "check_bind", check_then_swap)
    binds = sandbox.Binds()
    with pytest.raises(ProviderError) as e:
        binds.add(alice, "j-1", "workdir")
        _run(["sh", "-c", f"echo from-node > {alice}/out"], binds)  # (what happened without the refusal)
    now = f"is a link now, to {bob}" if level == "alice/proj" else f"now leads to {bob}"
    assert str(e.value) == f"local node sandbox: the workdir {alice} changed while it was checked (it {now}); " \
                           f"a job cannot be given it"
    assert sorted(p.name for p in bob.iterdir()) == ["who"]
    assert binds.fds == {} and binds.rw == []


def test_binds_given_to_one_sandbox_are_not_given_to_another(home, lab):
    binds = sandbox.Binds()
    binds.add(lab / "alice" / "proj", "j-1", "workdir")
    fd = binds.fds[lab / "alice" / "proj"]
    with sandbox.wrap(["true"], binds, tags={}, chdir="/") as cmd:
        assert fd in cmd.pass_fds and binds.fds == {}
    with pytest.raises(OSError):  # the command closed it
        os.fstat(fd)
    with pytest.raises(ProviderError, match="given to a sandbox already"):
        sandbox.wrap(["true"], binds, tags={}, chdir="/")


def _provider(lab: Path, job: str) -> LocalProvider:
    """A local provider that holds alice's job ``job`` (workdir lab/alice/proj), as a server's
    controller does after reading the job's record."""
    provider = LocalProvider()
    provider._workdirs[job] = str(lab / "alice" / "proj")
    provider._owners[job] = "alice"
    return provider


def test_a_node_the_local_provider_launches_gets_the_checked_workdir(home, lab, monkeypatch):
    """The whole launch: the provider's binds, its guard (``--pass-fd`` for each descriptor),
    bwrap; the swap comes after the binds were made, before the guard starts bwrap."""
    monkeypatch.setenv("SFTCTL_NODE_SANDBOX", "bwrap")
    monkeypatch.setenv("SFTCTL_SERVER_WORKDIR_ROOTS", f"{lab}/{{user}}")
    alice, bob = lab / "alice" / "proj", lab / "bob" / "proj"
    moved: list[Path] = []
    wrap = sandbox.wrap

    def swap_then_wrap(*args, **kw):
        moved.append(_swap(alice, bob))
        return wrap(*args, **kw)

    monkeypatch.setattr(sandbox, "wrap", swap_then_wrap)
    provider = _provider(lab, "j-race")
    handle = provider.provision("j-race", "n0", 0, local_offering(1))
    script = f'cat {alice}/who > "$SFTCTL_NODE_DIR/seen"; echo from-node > {alice}/out\n'
    handle = provider.launch(handle, script, {}, attempt=1)
    os.waitpid(handle.pid, 0)  # the guard: it ends with the node
    seen = Path(handle.dir) / "seen"
    wait_for(seen.is_file, timeout_s=60, what="the node's answer")
    assert seen.read_text() == "alice\n", (Path(handle.dir) / "node.log").read_text(errors="replace")
    assert (moved[0] / "out").read_text() == "from-node\n"
    assert sorted(p.name for p in bob.iterdir()) == ["who"]


def test_a_workdir_swapped_for_a_link_out_of_the_owners_root_at_launch_is_refused(home, lab, monkeypatch):
    """The provider checks server.workdir_roots on the path, then binds it: a link into bob's
    root swapped in between is refused (the roots are judged on the directory pinned)."""
    monkeypatch.setenv("SFTCTL_NODE_SANDBOX", "bwrap")
    monkeypatch.setenv("SFTCTL_SERVER_WORKDIR_ROOTS", f"{lab}/{{user}}")
    alice, bob = lab / "alice" / "proj", lab / "bob" / "proj"
    refusal = workdir_roots.refusal
    calls: list[str] = []

    def refuse_then_swap(workdir, owner, *args, **kw):
        answer = refusal(workdir, owner, *args, **kw)
        if not calls:
            _swap(alice, bob)
        calls.append(workdir)
        return answer

    monkeypatch.setattr(workdir_roots, "refusal", refuse_then_swap)
    provider = _provider(lab, "j-roots")
    handle = provider.provision("j-roots", "n0", 0, local_offering(1))
    with pytest.raises(ProviderError) as e:
        provider.launch(handle, f"echo from-node > {alice}/out\n", {}, attempt=1)
    assert str(e.value) == (f"local node sandbox: workdir: {bob} ({alice}, links followed) is outside alice's "
                            f"workdir roots on this server ({lab}/alice); put the job's files in a directory "
                            f"under one of them and name it as workdir")
    assert sorted(p.name for p in bob.iterdir()) == ["who"]
    assert not (Path(handle.dir) / "node.log").exists()
