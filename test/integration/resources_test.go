package integration

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// TestFDExhaustion: a guest that looks up and opens more files than
// RLIMIT_NOFILE allows gets EMFILE (or ENFILE) for the requests that need a
// new fd, while requests that need none keep working; once it forgets and
// releases, everything works again and the daemon's fd count is back where
// it started.
func TestFDExhaustion(t *testing.T) {
	const limit = 128
	d := startDaemon(t, "--rlimit-nofile", fmt.Sprint(limit))
	const files = 3 * limit
	for i := range files {
		if err := os.WriteFile(filepath.Join(d.dir, fmt.Sprintf("f%03d", i)), []byte{byte(i)}, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	c.mount()
	base := d.fdCount()
	if base >= limit {
		t.Fatalf("%d fds open before any lookup, limit %d", base, limit)
	}

	type held struct{ node, fh uint64 }
	var hs []held
	var hit error
	for i := 0; i < files && hit == nil; i++ {
		e, err := c.Lookup(vmm.RootID, fmt.Sprintf("f%03d", i))
		if err != nil {
			hit = err
			break
		}
		h := held{node: e.NodeID}
		if h.fh, err = c.Open(e.NodeID, syscall.O_RDONLY); err != nil {
			hit = err
			c.Forget(e.NodeID, 1)
			break
		}
		hs = append(hs, h)
	}
	if !errors.Is(hit, syscall.EMFILE) && !errors.Is(hit, syscall.ENFILE) {
		t.Fatalf("after %d files: %v, want EMFILE or ENFILE", len(hs), hit)
	}
	t.Logf("EMFILE after %d looked-up and open files (limit %d, %d fds at start)", len(hs), limit, base)
	// Requests that need no new fd still work, on what the guest holds.
	c.check()
	if b := c.read(hs[0].node, hs[0].fh, 0, 1); len(b) != 1 || b[0] != 0 {
		t.Fatalf("READ while exhausted: %x", b)
	}
	// Several more attempts, all clean failures.
	for i := 0; i < 20; i++ {
		_, _, err := c.tryCreate(vmm.RootID, fmt.Sprintf("new%d", i), syscall.O_RDWR)
		if !errors.Is(err, syscall.EMFILE) && !errors.Is(err, syscall.ENFILE) {
			t.Fatalf("CREATE while exhausted: %v", err)
		}
	}
	d.alive()

	for _, h := range hs {
		if err := c.Release(h.node, h.fh, syscall.O_RDONLY); err != nil {
			t.Fatal(err)
		}
		if err := c.Forget(h.node, 1); err != nil {
			t.Fatal(err)
		}
	}
	c.check() // FORGET has no reply: a later request is served after it
	if n := d.fdCount(); n != base {
		t.Errorf("%d fds after releasing everything, %d at start", n, base)
	}
	// Recovered: a full round of lookups and opens up to half the limit.
	for i := 0; i < limit/2; i++ {
		e := c.lookup(vmm.RootID, fmt.Sprintf("f%03d", files-1-i))
		fh := c.open(e.NodeID, syscall.O_RDONLY)
		c.Release(e.NodeID, fh, syscall.O_RDONLY)
		c.Forget(e.NodeID, 1)
	}
	c.roundTrip(d, "after", pattern(7, 10000))
}
