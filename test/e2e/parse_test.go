//go:build linux

package e2e

import (
	"reflect"
	"strings"
	"testing"
)

// The parsers run without root or QEMU.

func TestParseLogfmt(t *testing.T) {
	line := `time=2026-11-30T09:32:06.850Z level=DEBUG msg="fuse request" queue=1 unique=2 opcode=INIT nodeid=0 len=104 error=-38 latency=146.597µs note="a \"q\" b"`
	got := parseLogfmt(line)
	want := map[string]string{
		"time": "2026-11-30T09:32:06.850Z", "level": "DEBUG", "msg": "fuse request", "queue": "1", "unique": "2",
		"opcode": "INIT", "nodeid": "0", "len": "104", "error": "-38", "latency": "146.597µs", "note": `a "q" b`,
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseLogfmt:\n got %v\nwant %v", got, want)
	}
	if kv := parseLogfmt("# /bin/govirtiofsd --socket-path x"); kv["msg"] != "" {
		t.Fatalf("comment line parsed as %v", kv)
	}
}

func TestParseConsole(t *testing.T) {
	lines := []string{
		"SeaBIOS", "\x1bc\x1b[?7l\x1b[2JE2E-BOOT kernel=6.1.0-57-cloud-amd64 uptime=3.1",
		"E2E-STEP-BEGIN mount", "E2E-STEP mount rc=0", "E2E-MOUNTED tag=myfs uptime=3.2",
		"E2E-STEP-BEGIN cat", "cat: can't open '/mnt/hello': Connection refused", "E2E-STEP cat rc=1",
		"E2E-ASK next", "E2E-ANSWER reboot", "E2E-DONE action=reboot uptime=3.5",
		"E2E-BOOT kernel=6.1.0-57-cloud-amd64 uptime=3.0",
		"E2E-STEP-BEGIN cat", "hello", "E2E-STEP cat rc=0",
	}
	g := parseConsole(lines)
	if g.Boots != 2 || !reflect.DeepEqual(g.Uptimes, []string{"3.2"}) || !reflect.DeepEqual(g.Done, []string{"reboot"}) {
		t.Fatalf("parseConsole: %+v", g)
	}
	want := []guestStep{
		{Boot: 1, Name: "mount", RC: 0},
		{Boot: 1, Name: "cat", RC: 1, Output: []string{"cat: can't open '/mnt/hello': Connection refused"}},
		{Boot: 2, Name: "cat", RC: 0, Output: []string{"hello"}},
	}
	if !reflect.DeepEqual(g.Steps, want) {
		t.Fatalf("steps:\n got %+v\nwant %+v", g.Steps, want)
	}
}

func TestParseFioTerse(t *testing.T) {
	// Fields 1-9 then zeros up to the write group (47-50), as fio 3.33 prints them.
	f := make([]string, 130)
	for i := range f {
		f[i] = "0"
	}
	f[0], f[1], f[2], f[4] = "3", "fio-3.33", "j", "0"
	f[5], f[6], f[7], f[8] = "32768", "71545", "69.5", "458"
	f[46], f[47], f[48], f[49] = "8192", "6517", "1629", "1257"
	line := strings.Join(f, ";")
	r, err := parseFioTerse("seq-1m-direct-read", line)
	if err != nil || r.KiB != 32768 || r.BWKiB != 71545 || r.IOPS != 69.5 || r.RuntimeMS != 458 {
		t.Fatalf("read pass: %+v, %v", r, err)
	}
	w, err := parseFioTerse("rand-4k-direct-write", line)
	if err != nil || w.KiB != 8192 || w.BWKiB != 6517 || w.IOPS != 1629 || w.RuntimeMS != 1257 {
		t.Fatalf("write pass: %+v, %v", w, err)
	}
	if _, err := parseFioTerse("x-read", "3;fio;x;0;0"); err == nil {
		t.Fatal("short line accepted")
	}
	if m := reFio.FindStringSubmatch("E2E-FIO seq-1m-direct-read " + line); m == nil || m[1] != "seq-1m-direct-read" {
		t.Fatalf("reFio: %q", m)
	}
}

func TestParseResultLines(t *testing.T) {
	cases := map[string][2]string{
		"E2E-RESULT create.read hello":                  {"create.read", "hello"},
		"E2E-RESULT tmpfile.dir ":                       {"tmpfile.dir", ""},
		"E2E-RESULT tmpfile.dir":                        {"tmpfile.dir", ""},
		"\x1b[2JE2E-RESULT statx basic=1 mode=100604 x": {"statx", "basic=1 mode=100604 x"},
	}
	for line, want := range cases {
		m := reResult.FindStringSubmatch(line)
		if m == nil || m[1] != want[0] || m[2] != want[1] {
			t.Errorf("%q: %q, want %q", line, m, want)
		}
	}
	if m := reMismatch.FindStringSubmatch("E2E-MISMATCH a.b got=[1] want=[2]"); m == nil || m[1] != "a.b" {
		t.Errorf("reMismatch: %q", m)
	}
}

// The tables the side-by-side comparison relies on are complete.
func TestDifferenceTables(t *testing.T) {
	for k, d := range intendedDifferences {
		if d.Reason == "" || d.Ours == d.Reference {
			t.Errorf("intendedDifferences[%q]: needs a reason and two different values: %+v", k, d)
		}
	}
	for k, reason := range KnownFailures {
		if reason == "" {
			t.Errorf("KnownFailures[%q]: no reason", k)
		}
	}
}
