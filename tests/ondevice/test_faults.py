"""Bad inputs of the ondevice area (ondevice/faults*.py), one test per case class: every case must end in a
recovery that was checked or in one `error:` line naming a fix: no traceback, no hang, nothing lost.
benchmarks/reliability.py runs the same cases, each in its own process, and reports the counts."""
import pytest

from ondevice import fault_suite as faults

CASES = faults.load_cases()


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
  return faults.Workspace(str(tmp_path_factory.mktemp("faults")))


@pytest.mark.parametrize("klass", faults.classes())
def test_fault_class(ws, klass, request):
  if klass == "ring_peer":
    request.applymarker(pytest.mark.multiprocess)
  bad = []
  for c in [c for c in CASES if c.klass == klass]:
    o = faults.run_case(c, ws)
    if o.kind not in c.acceptable or o.data_lost:
      bad.append(f"{c.name}: {o.kind}{' + data lost' if o.data_lost else ''}: {o.detail}")
  assert not bad, "\n".join(bad)


def test_every_class_has_cases_and_there_are_at_least_40():
  assert len(CASES) >= 40 and all(sum(c.klass == k for c in CASES) >= 2 for k in faults.classes())
