package bench

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
)

// TestScaleSmall runs the scale benchmark at unit-test size (300 files on
// each file system, every daemon found) so that it cannot rot: every run
// completes, every inode is found, and the figures make sense — a daemon
// holding inodes by fd holds one more per file, one holding them by handle
// on tmpfs does not, and each OPEN holds one.
func TestScaleSmall(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the scale run mounts its shares: needs root")
	}
	dir := t.TempDir()
	bins := ScaleBins{Ours: filepath.Join(dir, "govirtiofsd")}
	if err := (launch.Build{Static: true, Repo: filepath.Join("..", ".."), Out: bins.Ours}).Run(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(launch.ReferenceBin); err == nil {
		bins.Ref = launch.ReferenceBin
	}
	for _, p := range []*string{&bins.Rust, &bins.Rust14} {
		name := map[*string]string{&bins.Rust: "virtiofsd-rust", &bins.Rust14: "virtiofsd-rust-1.14"}[p]
		if abs, err := launch.Existing(filepath.Join("..", "..", ".cache", "peers", "bin", name)); err == nil {
			*p = abs
		}
	}
	// A file system this machine cannot make (no loop device, no
	// overlayfs) is left out, said in the log.
	var fsTypes []string
	for _, fs := range ScaleFS {
		s, err := prepareScaleShare(fs, dir, 1)
		if err != nil {
			t.Logf("%s left out: %v", fs, err)
			continue
		}
		s.close()
		fsTypes = append(fsTypes, fs)
	}
	if len(fsTypes) == 0 {
		t.Fatal("no file system to run on")
	}
	const files, opens = 300, 40
	var out bytes.Buffer
	o := ScaleOptions{Configs: ScaleConfigs(bins), FS: fsTypes, Files: []int{files}, Opens: opens, Rounds: 1,
		Depth: 2, Dir: dir, Settle: 20 * time.Millisecond, Out: &out}
	runs, err := RunScale(o)
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}
	if want := len(o.FS) * len(o.Configs); len(runs) != want && !strings.Contains(out.String(), "left out") {
		t.Errorf("%d runs, want %d", len(runs), want)
	}
	for _, r := range runs {
		if r.Found != files+1 || r.Lookups != files+1 || len(r.LookupErrors) != 0 {
			t.Errorf("%s on %s: %d of %d LOOKUPs answered with an entry (errors %s), want all %d",
				r.Config, r.FS, r.Found, r.Lookups, fmtErrnos(r.LookupErrors), files+1)
		}
		if r.Opened != opens || r.FDs[2]-r.FDs[1] < opens {
			t.Errorf("%s on %s: %d OPENs answered, fds %d → %d", r.Config, r.FS, r.Opened, r.FDs[1], r.FDs[2])
		}
		if r.Mem[0] <= 0 || r.Nofile == 0 || r.LookupTime <= 0 {
			t.Errorf("%s on %s: memory %d KiB, RLIMIT_NOFILE %d, time %v", r.Config, r.FS, r.Mem[0], r.Nofile, r.LookupTime)
		}
		byHandle := r.FS == "tmpfs" && (r.Config == "ours" || r.Config == "ours-budget" || r.Config == "rust-1.14")
		switch held := r.FDs[1] - r.FDs[0]; {
		case byHandle && held > 10:
			t.Errorf("%s on %s holds inodes by file handle, but %d more fds after the lookups", r.Config, r.FS, held)
		case (r.Config == "ours-never" || r.Config == "ref") && held < files:
			t.Errorf("%s on %s holds an fd per inode, but %d more fds after %d lookups", r.Config, r.FS, held, files+1)
		}
	}
	for _, fs := range o.FS {
		if !strings.Contains(out.String(), "scale: "+fs+",") {
			t.Errorf("no table for %s", fs)
		}
	}
}
