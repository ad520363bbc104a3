package main

import (
	"log/slog"
	"os"
	"strings"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough"
	"github.com/govirtiofsd/govirtiofsd/internal/sandbox"
)

// The first process's decision on inode file handles, the sandbox's
// capabilities and the passthrough's mode that follow from it.
func TestFileHandleDecision(t *testing.T) {
	share := t.TempDir()
	usable := handlesUsable
	if err := passthrough.ProbeFileHandles(share); err != nil {
		t.Logf("file handles unusable on %s here (%v): expecting the fallback", share, err)
		usable = handlesNotPermitted
		if os.Geteuid() == 0 {
			usable = handlesNoFS
		}
	}
	for _, tc := range []struct {
		name string
		args []string
		want handleDecision
		mode passthrough.FileHandleMode
		cap  bool
	}{
		{"default", nil, usable, passthrough.FileHandlesPrefer, usable == handlesUsable},
		{"never", []string{"--inode-file-handles=never"}, handlesOff, passthrough.FileHandlesNever, false},
		{"never, file-handles migration", []string{"--inode-file-handles=never", "--migration-mode=file-handles"},
			handlesOff, passthrough.FileHandlesNever, true},
		{"user namespace", []string{"--uid-map=:0:1000:1:", "--gid-map=:0:1000:1:"},
			handlesNotPermitted, passthrough.FileHandlesNever, false},
		{"modcaps", []string{"--modcaps=-dac_read_search"}, handlesNotPermitted, passthrough.FileHandlesNever, false},
		// No sandbox, no capability change: --modcaps has no effect.
		{"modcaps, no sandbox", []string{"--modcaps=-dac_read_search", "--sandbox=none"}, usable, passthrough.FileHandlesPrefer, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := parseOK(t, append([]string{"--socket-path=/tmp/x.sock", "--shared-dir=" + share}, tc.args...)...)
			got, why := probeFileHandles(o)
			if got != tc.want {
				t.Fatalf("decision %q (%s), want %q", got, why, tc.want)
			}
			if (got == handlesUsable || got == handlesOff) != (why == "") {
				t.Errorf("decision %q with reason %q", got, why)
			}
			o.handles = got
			if m, err := fileHandleMode(o); err != nil || m != tc.mode {
				t.Errorf("passthrough mode %v (%v), want %v", m, err, tc.mode)
			}
			cfg, err := sandboxConfig(o, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			if has := cfg.Caps&sandbox.FileHandleCaps != 0; has != tc.cap {
				t.Errorf("CAP_DAC_READ_SEARCH kept: %v, want %v (caps %s)", has, tc.cap, cfg.Caps)
			}
		})
	}
}

// mandatory refuses to start where prefer falls back; a later stage takes
// the decision from the environment, and refuses to start without it.
func TestFileHandleDecisionStages(t *testing.T) {
	t.Setenv(envFileHandles, "")
	t.Setenv(envFileHandlesWhy, "")
	share := t.TempDir()
	log := slog.New(slog.DiscardHandler)
	o := parseOK(t, "--socket-path=/tmp/x.sock", "--shared-dir="+share, "--inode-file-handles=mandatory",
		"--uid-map=:0:1000:1:", "--gid-map=:0:1000:1:")
	d := &daemon{o: o, proc: process{first: true}, log: log}
	if err := d.decideFileHandles(); err == nil || !strings.Contains(err.Error(), "mandatory") {
		t.Fatalf("mandatory in a user namespace: %v", err)
	}
	o = parseOK(t, "--socket-path=/tmp/x.sock", "--shared-dir="+share, "--uid-map=:0:1000:1:", "--gid-map=:0:1000:1:")
	d = &daemon{o: o, proc: process{first: true}, log: log}
	if err := d.decideFileHandles(); err != nil {
		t.Fatal(err)
	}
	if v := os.Getenv(envFileHandles); v != string(handlesNotPermitted) {
		t.Fatalf("%s=%q after the first process", envFileHandles, v)
	}
	later := &daemon{o: parseOK(t, "--socket-path=/tmp/x.sock", "--shared-dir="+share), log: log}
	if err := later.decideFileHandles(); err != nil || later.o.handles != handlesNotPermitted {
		t.Fatalf("a later stage: %v, %q", err, later.o.handles)
	}
	os.Setenv(envFileHandles, "usable; or anything")
	if err := later.decideFileHandles(); err == nil {
		t.Fatal("a later stage accepted a bad decision")
	}
}

func parseOK(t *testing.T, args ...string) *Options {
	t.Helper()
	o, err := parse(args)
	if err != nil {
		t.Fatalf("%q: %v", args, err)
	}
	return o
}
