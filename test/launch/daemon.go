package launch

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
)

// ReferenceBin is where Debian's qemu-system-common installs the C
// virtiofsd.
const ReferenceBin = "/usr/lib/qemu/virtiofsd"

// Kind is which daemon a command line is for: each spells it its own way.
type Kind int

const (
	Ours      Kind = iota // govirtiofsd
	Reference             // the C virtiofsd (ReferenceBin)
	Rust                  // the Rust virtiofsd (make test-deps: .cache/peers/bin/virtiofsd-rust)
)

// Line is a daemon's command line: what it serves, on which socket.
type Line struct {
	Kind   Kind
	Socket string
	Share  string
	// Cache is the cache mode in our and the Rust daemon's words (never,
	// auto, always; the C daemon's none is never); "" leaves the
	// daemon's default.
	Cache string
	Extra []string // after the rest, in the daemon's own spelling
}

// Args is the command line after the binary.
func (l Line) Args() []string {
	if l.Kind == Reference {
		a := []string{"--socket-path=" + l.Socket, "-o", "source=" + l.Share}
		if c := l.Cache; c != "" {
			a = append(a, "-o", "cache="+strings.Replace(c, "never", "none", 1))
		}
		return append(a, l.Extra...)
	}
	a := []string{"--socket-path", l.Socket, "--shared-dir", l.Share}
	if l.Cache != "" {
		a = append(a, "--cache", l.Cache)
	}
	return append(a, l.Extra...)
}

// Build is how a test compiles govirtiofsd (./cmd/govirtiofsd).
type Build struct {
	// Race builds with the race detector: a dynamic binary, which runs
	// only with --sandbox none and --seccomp none (the race runtime makes
	// system calls outside the allowlist).
	Race bool
	// Static builds as make build does: cgo, netgo and osusergo, linked
	// statically, -trimpath.
	Static bool
	Tags   []string // more build tags (sandboxtest: the seccomp test hook)
	Repo   string   // the repository's top directory
	Out    string   // the binary to write
}

// Run compiles the daemon into b.Out.
func (b Build) Run() error {
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	args, tags := []string{"build"}, b.Tags
	if b.Race {
		args = append(args, "-race")
	}
	if b.Static {
		args = append(args, "-trimpath", "-ldflags", "-linkmode external -extldflags -static")
		tags = append([]string{"netgo", "osusergo"}, tags...)
	}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	cmd := exec.Command(goTool, append(args, "-o", b.Out, "./cmd/govirtiofsd")...)
	cmd.Dir = b.Repo
	if b.Static {
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building the daemon (go %s): %v\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// Existing is path made absolute, once it is known to be there: a daemon
// built beforehand (make build's bin/govirtiofsd, or what an environment
// variable names).
func Existing(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(abs); err != nil {
		return "", err
	}
	return abs, nil
}

// ShellQuote is args as a shell would need them, quoted where needed: a
// command line to read in a log and paste.
func ShellQuote(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a != "" && strings.IndexFunc(a, func(r rune) bool {
			return !(r == '-' || r == '_' || r == '.' || r == '/' || r == '=' || r == ',' || r == ':' || r == '+' ||
				(r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9'))
		}) < 0 {
			q[i] = a
		} else {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(q, " ")
}
