package passthrough

import (
	"os"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// TestFileWait: a file on tmpfs is local (raw syscalls); one on procfs, as
// any file system not known to be local, may wait.
func TestFileWait(t *testing.T) {
	for _, tc := range []struct {
		path string
		want bufvec.Wait
	}{
		{"/dev/shm", bufvec.Bounded},
		{"/proc/self/status", bufvec.MayWait},
	} {
		f, err := os.Open(tc.path)
		if err != nil {
			t.Skip(err)
		}
		if got := fileWait(int(f.Fd())); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.path, got, tc.want)
		}
		f.Close()
	}
	if got := fileWait(-1); got != bufvec.MayWait {
		t.Errorf("bad fd: %v, want MayWait", got)
	}
}
