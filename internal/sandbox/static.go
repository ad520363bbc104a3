package sandbox

import (
	"debug/elf"
	"fmt"
	"io"
	"strings"
)

// The namespace and chroot sandboxes execveat their final stage after the
// process's root has become the shared directory. A dynamically linked
// binary names its loader (PT_INTERP, e.g. /lib64/ld-linux-x86-64.so.2) by
// path, and no such path exists inside a share: the exec fails with ENOENT
// long after start-up, in words that do not say why. checkStatic says it
// first, and how to get a binary that works.

// interpreter returns the ELF program interpreter the executable at path
// needs, or "" for a statically linked one.
func interpreter(path string) (string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		b, err := io.ReadAll(io.LimitReader(p.Open(), 4096))
		if err != nil {
			return "", err
		}
		return strings.TrimRight(string(b), "\x00"), nil
	}
	return "", nil
}

// checkStatic refuses a dynamically linked daemon in a mode that changes
// the root before its last exec.
func (cfg *Config) checkStatic(exe string) error {
	if cfg.Mode == None {
		return nil
	}
	interp, err := interpreter(exe)
	if err != nil {
		return fmt.Errorf("sandbox: reading %s: %w", exe, err)
	}
	if interp == "" {
		return nil
	}
	return fmt.Errorf("--sandbox %s needs a statically linked binary, and this one is dynamically linked (it needs %s): "+
		"the sandbox's last stage starts inside the shared directory, where no loader exists. "+
		"Build it with `make` (CGO_ENABLED=1 go build -tags netgo,osusergo -ldflags '-linkmode external -extldflags \"-static\"' ./cmd/govirtiofsd), "+
		"or run with --sandbox none", cfg.Mode, interp)
}
