// The layering of the daemon's packages, checked: data flows vhostuser →
// virtqueue → bufvec → fuse → passthrough, a lower layer never imports a
// higher one, and cmd/govirtiofsd is the only place the layers meet. A new
// import between the project's packages fails this test until the table
// below says why it is right.
package internal_test

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/govirtiofsd/govirtiofsd/"

// allowed lists, for every package under internal/ and cmd/, the project's
// packages its non-test files may import. A package missing here fails the
// test: a new package states its place in the layering.
var allowed = map[string][]string{
	"cmd/govirtiofsd":      {"internal/fuse", "internal/passthrough", "internal/sandbox", "internal/vhostuser"},
	"internal/vhostuser":   {"internal/virtqueue", "internal/bufvec"},
	"internal/virtqueue":   {"internal/bufvec"},
	"internal/fuse":        {"internal/bufvec"},
	"internal/passthrough": {"internal/bufvec", "internal/passthrough/migstate"},
	// The migration state and its encodings: passthrough's alone, and
	// free of the file system it describes.
	"internal/passthrough/migstate": nil,
	"internal/bufvec":               nil,
	"internal/sandbox":              nil,
}

// allowedInTests adds what a package's tests may import beyond allowed:
// passthrough's external test proves it satisfies fuse.FileSystem without
// the package importing fuse; the vhost-user tests drive the back end with
// the independent front end of test/vmm; the command's tests start the
// daemon as the other test packages do (test/launch).
var allowedInTests = map[string][]string{
	"cmd/govirtiofsd":      {"test/launch", "test/vmm"},
	"internal/passthrough": {"internal/fuse", "internal/passthrough"},
	"internal/vhostuser":   {"test/vmm"},
}

func TestLayering(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, top := range []string{"internal", "cmd"} {
		err := filepath.WalkDir(filepath.Join(root, top), func(path string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return err
			}
			if d.Name() == "testdata" {
				return filepath.SkipDir
			}
			rel, _ := filepath.Rel(root, path)
			if checkDir(t, path, filepath.ToSlash(rel)) {
				seen[filepath.ToSlash(rel)] = true
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	for pkg := range allowed {
		if !seen[pkg] {
			t.Errorf("%s is in the layering table but has no Go files", pkg)
		}
	}
}

// checkDir checks the imports of the Go files in dir, the package pkg, and
// reports whether it holds a package of non-test files.
func checkDir(t *testing.T, dir, pkg string) bool {
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	hasCode := false
	for _, f := range files {
		test := strings.HasSuffix(f, "_test.go")
		hasCode = hasCode || !test
		ok := allowed[pkg]
		if test {
			ok = append(slices.Clone(ok), allowedInTests[pkg]...)
		}
		for _, imp := range imports(t, f) {
			dep, ours := strings.CutPrefix(imp, module)
			if !ours {
				continue
			}
			if !slices.Contains(ok, dep) {
				t.Errorf("%s: %s must not import %s", filepath.Base(f), pkg, dep)
			}
		}
	}
	if _, known := allowed[pkg]; hasCode && !known {
		t.Errorf("package %s is not in the layering table (internal/layering_test.go)", pkg)
	}
	return hasCode
}

func imports(t *testing.T, file string) []string {
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range f.Imports {
		p, err := strconv.Unquote(s.Path.Value)
		if err != nil {
			t.Fatalf("%s: import %s: %v", file, s.Path.Value, err)
		}
		out = append(out, p)
	}
	return out
}
