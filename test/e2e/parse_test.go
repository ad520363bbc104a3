//go:build linux

package e2e

import (
	"reflect"
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
