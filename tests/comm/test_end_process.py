"""end_process(): Note [Gloo teardown] -- output flushed, the exit status kept, no teardown run."""
import subprocess
import sys
import textwrap


def test_end_process_flushes_output_keeps_the_code_and_skips_teardown():
    code = textwrap.dedent("""
        import atexit, logging, sys
        from ncclavg.comm import end_process
        atexit.register(lambda: print("teardown ran"))
        logging.basicConfig(stream=sys.stderr)
        print("unterminated line", end="")          # still in the buffer: must be flushed
        logging.getLogger("x").warning("logged")
        end_process(3)
        print("not reached")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "unterminated line"
    assert "logged" in r.stderr and "teardown ran" not in r.stdout + r.stderr
