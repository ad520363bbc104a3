package integration

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// TestFDBudget serves a share held by O_PATH fds with --inode-fd-budget 16:
// the guest holds 100 more inodes than that, so the others' fds are closed
// (the metrics say so). The guest's RENAME, LINK and UNLINK of evicted
// inodes keep them reachable; a host-side rename, replace, or swap of an
// evicted inode's parent for a symlink to a look-alike outside the share
// answers ESTALE: never another file, never one outside.
func TestFDBudget(t *testing.T) {
	msock := filepath.Join(t.TempDir(), "metrics.sock")
	e := escStart(t, "--inode-fd-budget", "16", "--inode-file-handles", "never", "--metrics-addr", "unix:"+msock)
	host := func(p string) string { return filepath.Join(e.d.dir, p) }
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	const targets = 8
	type target struct{ dir, file, ino uint64 }
	var tg [targets]target
	for i := range targets {
		must(os.Mkdir(host(fmt.Sprint("p", i)), 0o755))
		must(os.WriteFile(host(fmt.Sprintf("p%d/t", i)), []byte(fmt.Sprint("target ", i)), 0o644))
		tg[i].dir = e.c.lookup(vmm.RootID, fmt.Sprint("p", i)).NodeID
		ent := e.c.lookup(tg[i].dir, "t")
		tg[i].file, tg[i].ino = ent.NodeID, ent.Attr.Ino
	}
	must(os.Mkdir(host("fill"), 0o755))
	fill := e.c.lookup(vmm.RootID, "fill").NodeID
	flood := func(round int) {
		for k := range 100 {
			name := fmt.Sprintf("r%d-%d", round, k)
			must(os.WriteFile(host("fill/"+name), nil, 0o644))
			e.c.lookup(fill, name)
		}
	}
	flood(0)
	// The daemon names what it holds in the background when the budget is
	// first reached; evictions follow.
	for deadline := time.Now().Add(opTimeout); ; time.Sleep(10 * time.Millisecond) {
		s := scrape(t, msock)
		if s[`govirtiofsd_inodes_evicted`] >= 80 && s[`govirtiofsd_inode_fd_budget`] == 16 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 100 lookups: %v inodes evicted, budget %v", s[`govirtiofsd_inodes_evicted`], s[`govirtiofsd_inode_fd_budget`])
		}
	}
	getattr := func(i int, want syscall.Errno) {
		t.Helper()
		a, err := e.c.Getattr(tg[i].file)
		errno := escErrno(t, "GETATTR", err)
		switch {
		case errno != want:
			t.Errorf("GETATTR of target %d: %v, want %v", i, errno, want)
		case errno == 0 && a.Attr.Ino != tg[i].ino:
			t.Errorf("GETATTR of target %d: ino %d, want %d", i, a.Attr.Ino, tg[i].ino)
		}
	}

	// The guest's changes.
	if _, errno := e.do(vmm.OpRename, tg[0].dir, append(le64(nil, tg[1].dir), append(escZ("t"), escZ("moved")...)...), 0); errno != 0 {
		t.Fatalf("RENAME p0/t p1/moved: %v", errno)
	}
	if _, errno := e.entry(vmm.OpLink, tg[3].dir, append(le64(nil, tg[2].file), escZ("link")...)); errno != 0 {
		t.Fatalf("LINK p2/t p3/link: %v", errno)
	}
	for _, i := range []int{2, 4} {
		if _, errno := e.do(vmm.OpUnlink, tg[i].dir, escZ("t"), 0); errno != 0 {
			t.Fatalf("UNLINK p%d/t: %v", i, errno)
		}
	}
	if _, errno := e.do(vmm.OpRename, vmm.RootID, append(le64(nil, vmm.RootID), append(escZ("p5"), escZ("p5-renamed")...)...), 0); errno != 0 {
		t.Fatalf("RENAME p5: %v", errno)
	}
	flood(1)
	for _, i := range []int{0, 2, 4, 5} {
		getattr(i, 0)
	}

	// The host's changes to evicted inodes.
	must(os.Rename(host("p6/t"), host("p6/t2")))
	must(os.WriteFile(host("p1/new"), []byte("impostor"), 0o644))
	must(os.Rename(host("p1/new"), host("p1/t")))
	look := filepath.Join(e.out, "lookalike")
	must(os.Mkdir(look, 0o755))
	must(os.WriteFile(filepath.Join(look, "t"), []byte("outside"), 0o644))
	must(os.Rename(host("p7"), host("p7.old")))
	must(os.Symlink(look, host("p7")))
	for _, i := range []int{1, 6, 7} {
		getattr(i, syscall.ESTALE)
		if _, errno := e.open(tg[i].file, syscall.O_RDONLY); errno != syscall.ESTALE {
			t.Errorf("OPEN of target %d: %v, want ESTALE", i, errno)
		}
	}
	getattr(3, 0) // untouched
	s := scrape(t, msock)
	if s[`govirtiofsd_inode_stale_total`] < 6 || s[`govirtiofsd_inode_reopens_total`] == 0 {
		t.Errorf("metrics: %v ESTALE, %v reopens", s[`govirtiofsd_inode_stale_total`], s[`govirtiofsd_inode_reopens_total`])
	}
	e.d.alive()
	e.c.check()
	noViolations(t, e.dev)
}
